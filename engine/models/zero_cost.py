"""A model that costs nothing to run, for measuring the engine around it.

``ZeroCostForCausalLM`` has the interface of ``LlamaForCausalLM`` (``spec``, ``forward``,
``compute_logits``, ``model.embed_tokens``, ``model.layers``, ``lm_head``) but its forward runs no
layer and no attention: the hidden state of a token is its successor's id, and its logits are a
one-hot peak at that id. Generation is therefore a fixed, reproducible walk over the vocabulary:
after token ``t`` comes ``successor(t)`` (``t + stride`` over the ordinary tokens, wrapping past
the special ids 0-2), never EOS unless the checkpoint names an ``eos_after`` token. Everything
else in a step (scheduler, batch building, sampler, output processing) runs for real, so a step's
time is the engine's host overhead.

With a ``step_time`` (``StepTime``) the forward also waits as long as an accelerator would take
for the step's work, sleeping (the GIL and the cores free, as while a GPU computes): an emulated
accelerator under the real serving stack, for measuring routing, queueing and the planner where the
host is not the bottleneck (``pdserve/emulated``, ``engine.model_names``).

``create_zero_cost_model(path)`` writes a checkpoint directory (config.json with the
``PdserveZeroCostForCausalLM`` architecture, and the tiny models' word-level tokenizer) that
``engine.models.load_model`` builds this model from. It has no weights file: nothing is learned.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

ARCHITECTURE = "PdserveZeroCostForCausalLM"
NUM_SPECIAL = 3  # <unk>/<pad>, <s>, </s>: the walk never enters them (engine.tiny_model's ids)
EOS_TOKEN_ID = 2
PEAK = 30.0  # the chosen token's logit over 0 elsewhere: any sampler picks it (odds ~e^-30 per other)


def successor_table(vocab_size: int, stride: int = 1, eos_after: int | None = None) -> torch.Tensor:
    """``next[t]``: the token the model emits after ``t``."""
    if vocab_size <= NUM_SPECIAL:
        raise ValueError(f"vocab_size must exceed {NUM_SPECIAL} (the special tokens), got {vocab_size}")
    n = vocab_size - NUM_SPECIAL
    ids = torch.arange(vocab_size)
    nxt = NUM_SPECIAL + (ids - NUM_SPECIAL + stride) % n
    nxt[:NUM_SPECIAL] = NUM_SPECIAL
    if eos_after is not None:
        nxt[eos_after] = EOS_TOKEN_ID
    return nxt


class _SkippedLayer(nn.Module):
    """A decoder layer's place (``model.layers`` has ``num_layers`` entries, as the KV layout
    says); the zero-cost forward never calls it."""

    def forward(self, x, *args, **kwargs):
        raise RuntimeError("a zero-cost model's layers are never run")


class _Backbone(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(_SkippedLayer() for _ in range(num_layers))


@dataclass(frozen=True)
class StepTime:
    """An emulated accelerator's time for a step, in the shape of the planner's cost curves
    (``planner.costs``): ``base_s`` per forward (the weights read once), ``per_token_s`` per token
    computed (prompt or decode), ``per_ctx_s`` per (query token, context token) pair attended (a
    decode attends its whole context; a prompt chunk of ``q`` tokens ending at context ``L``,
    ``q * L - q * (q - 1) / 2`` pairs, causal)."""

    base_s: float
    per_token_s: float
    per_ctx_s: float

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"step_time.{name} must be a non-negative number of seconds, got {value!r}")

    def seconds(self, query_start_loc: list[int], seq_lens: list[int]) -> float:
        """The step's time: sequence ``i`` computes ``query_start_loc[i + 1] - query_start_loc[i]``
        tokens ending at context ``seq_lens[i]``."""
        tokens = query_start_loc[-1] - query_start_loc[0]
        pairs = sum(seq_lens)  # a decode's pairs: its context (most steps: decodes alone)
        if tokens != len(seq_lens):
            pairs = 0.0
            for i, length in enumerate(seq_lens):
                q = query_start_loc[i + 1] - query_start_loc[i]
                pairs += q * length - q * (q - 1) / 2
        return self.base_s + self.per_token_s * tokens + self.per_ctx_s * pairs


class ZeroCostForCausalLM(nn.Module):
    def __init__(
        self, spec, stride: int = 1, eos_after: int | None = None, step_time: dict | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.step_time = StepTime(**step_time) if step_time else None
        self.sleep = time.sleep  # the wait (a test records it instead)
        self.model = _Backbone(spec.vocab_size, spec.hidden_size, spec.num_layers)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer(
            "successor", successor_table(spec.vocab_size, stride, eos_after), persistent=False
        )

    @classmethod
    def from_spec(cls, spec, device: str | torch.device = "cpu", **pattern) -> ZeroCostForCausalLM:
        """Over another model's spec (its vocabulary, hidden size and layer count): the benchmark
        swaps one into an engine built from a real checkpoint."""
        with torch.device(device):
            return cls(spec, **pattern).eval()

    def forward(self, input_ids, positions, kv_cache, meta, num_layers: int | None = None) -> torch.Tensor:
        """``[T, hidden]``: every column of row ``i`` holds the id of the token after input ``i``.

        NOTE: float32 whatever the model dtype (bfloat16 holds integers exactly only up to 256),
        and a broadcast view: one gather and one cast per step, whatever the hidden size."""
        nxt = self.successor[input_ids].to(torch.float32)
        if self.step_time is not None and meta is not None:
            share = 1.0 if num_layers is None else num_layers / self.spec.num_layers  # a draft's layers
            self.sleep(share * self.step_time.seconds(meta.query_start_loc, meta.seq_lens_list))
        return nxt[:, None].expand(-1, self.spec.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[:, :1].long()
        logits = torch.zeros(hidden.shape[0], self.spec.vocab_size, dtype=torch.float32, device=hidden.device)
        return logits.scatter_(1, ids, PEAK)


def spec_from_config(cfg):
    """The ``ModelSpec`` of a zero-cost checkpoint's config (only the fields the engine reads
    matter: vocabulary, context, and the KV layout's layers, KV heads and head dim)."""
    from engine.models.llama import ModelSpec

    num_heads = cfg.num_attention_heads
    return ModelSpec(
        architecture=ARCHITECTURE,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope={},
        max_position_embeddings=cfg.max_position_embeddings,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_windows=(None,) * cfg.num_hidden_layers,
    )


def build_zero_cost_model(cfg, dtype: torch.dtype, device: str) -> ZeroCostForCausalLM:
    """The model of a checkpoint whose config names ``ARCHITECTURE`` (``load_model`` calls this)."""
    pattern = dict(getattr(cfg, "pdserve_zero_cost", None) or {})
    model = ZeroCostForCausalLM.from_spec(spec_from_config(cfg), device, **pattern)
    with torch.no_grad():
        for p in model.parameters():  # unused; zeros rather than uninitialised memory
            p.zero_()
    logger.info("built a zero-cost model (vocabulary %d, pattern %s)", cfg.vocab_size, pattern or "default")
    return model.to(dtype)


def create_zero_cost_model(
    path: str | Path,
    vocab_size: int = 512,
    max_position_embeddings: int = 8192 + 1024,
    num_layers: int = 1,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    head_dim: int = 8,
    stride: int = 1,
    eos_after: int | None = None,
    step_time: StepTime | None = None,
) -> Path:
    """Write a zero-cost checkpoint (config.json and tokenizer) to ``path`` and return it.

    ``num_layers``, ``num_kv_heads`` and ``head_dim`` size the engine's KV cache (allocated, never
    written). ``stride`` and ``eos_after`` set the walk: after token ``t`` comes ``t + stride``
    (over the ordinary ids), and after ``eos_after`` (if given) comes EOS. ``step_time``: each
    forward waits as an accelerator of those costs would take (an emulated accelerator)."""
    import transformers

    from engine.tiny_model import build_tokenizer

    if not 0 < stride < vocab_size - NUM_SPECIAL:
        raise ValueError(f"stride must be in [1, {vocab_size - NUM_SPECIAL}), got {stride}")
    if eos_after is not None and not 0 <= eos_after < vocab_size:
        raise ValueError(f"eos_after must be a token id below {vocab_size}, got {eos_after}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
        architectures=[ARCHITECTURE],
    )
    config.save_pretrained(path)
    # The pattern goes in by hand: transformers keeps unknown keys, but not every version writes them.
    cfg_file = path / "config.json"
    data = json.loads(cfg_file.read_text())
    data["pdserve_zero_cost"] = {"stride": stride, "eos_after": eos_after}
    if step_time is not None:
        data["pdserve_zero_cost"]["step_time"] = asdict(step_time)
    cfg_file.write_text(json.dumps(data, indent=2) + "\n")
    build_tokenizer(vocab_size).save_pretrained(path)
    logger.info("wrote a zero-cost model (vocabulary %d) to %s", vocab_size, path)
    return path
