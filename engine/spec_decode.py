"""Speculative decoding: propose k tokens cheaply, verify them in one pass of the target.

The scheduler gives a speculating decode ``1 + k`` slots (``SchedulerOutput.num_spec_tokens``). In
the same step the runner asks the ``Speculator`` for drafts, runs the target over the last token and
the drafts as one short prefill chunk (the attention backends' causal varlen path), and verifies
them here (``engine.rejection_sampler``): between 1 and k + 1 tokens come out. The scheduler then
rolls ``num_computed_tokens`` back over the rejected positions; their KV stays in the slots, unread,
until the next tokens overwrite it (a block is registered in the prefix cache only once full of
accepted tokens).

Proposers:
- ``NgramProposer``: prompt lookup over the sequence's own tokens; no model, no KV.
- ``ModelProposer`` over a draft model with its own KV cache, laid out on the target's block tables
  (same block ids, so the scheduler allocates for both). The draft's KV lags the target's: it
  catches up on whatever positions it has not computed (a new sequence's prompt, a transferred
  prompt on a decode worker, the last accepted token) in its first pass of each step, then drafts one
  token per pass.
- ``ModelProposer`` in early-exit mode: the target's first layers and head, on the target's own KV
  cache (those layers' KV of accepted tokens is the target's, so there is nothing to catch up).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.batch import build_batch
from engine.kv_cache import KVLayout
from engine.rejection_sampler import accepted_prefix, rejection_sample
from engine.sampler import SamplingBatch, row_argmax, sample_seed
from engine.spec_config import SpeculativeConfig

logger = logging.getLogger(__name__)

# (seq id, runner state, positions computed before this step, drafts wanted)
DraftItem = tuple[str, object, int, int]


@dataclass(slots=True)
class SpecStats:
    """Counters since start: a draft is one sequence's proposal in one step."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_spec_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class NgramProposer:
    """The tokens that followed the latest earlier occurrence of the sequence's longest suffix (of
    ``max_n`` down to ``min_n`` tokens); nothing when the suffix never occurred before."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, items: list[DraftItem]) -> dict[str, list[int]]:
        return {seq_id: self.lookup(state.token_ids[: c + 1], k) for seq_id, state, c, k in items}

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = len(arr)
        # Where an earlier occurrence of the last token ends a match; latest first.
        ends = np.flatnonzero(arr[:-1] == arr[-1])[::-1]
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = arr[n_tok - n :]
            for j in ends:
                if j + 1 >= n and np.array_equal(arr[j + 1 - n : j + 1], suffix):
                    return arr[j + 1 : j + 1 + k].tolist()
        return []

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        pass

    def drop(self, seq_id: str) -> None:
        pass

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass


class ModelProposer:
    """Greedy drafts from a model: a draft model on its own KV cache, or (``num_layers``) the
    target's first layers on the target's cache."""

    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device,
        backend,
        num_layers: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.num_layers = num_layers  # early exit: the draft's KV is the target's own
        self.computed: dict[str, int] = {}  # draft model: positions whose draft KV is valid
        self._pending: dict[str, tuple[int, int]] = {}  # seq -> (c, drafts written this step)

    @torch.inference_mode()
    def propose(self, items: list[DraftItem]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {seq_id: [] for seq_id, *_ in items}
        # The first pass catches up (several tokens for some) and drafts one token; later passes one.
        spans = {}
        for seq_id, state, c, k in items:
            start = c if self.num_layers is not None else min(self.computed.get(seq_id, 0), c)
            spans[seq_id] = (state.token_ids[start : c + 1], start, state.block_ids)
            self._pending[seq_id] = (c, k)
        for i in range(max(k for *_, k in items)):
            tokens = self._draft_pass(spans)
            for seq_id, tok in tokens.items():
                drafts[seq_id].append(tok)
            spans = {
                seq_id: ([tok], c + i + 1, state.block_ids)
                for seq_id, state, c, k in items
                if k > i + 1 and (tok := tokens.get(seq_id)) is not None
            }
        return drafts

    def _draft_pass(self, spans: dict[str, tuple[list[int], int, list[int]]]) -> dict[str, int]:
        order = sorted(spans, key=lambda s: (len(spans[s][0]) != 1, -spans[s][1] - len(spans[s][0])))
        input_ids, positions, meta = build_batch(
            [spans[s] for s in order], self.block_size, self.device, self.backend
        )
        hidden = self.model(input_ids, positions, self.kv_cache, meta, num_layers=self.num_layers)
        last = [q - 1 for q in meta.query_start_loc[1:]]
        tokens = row_argmax(self.model.compute_logits(hidden[last])).tolist()
        return dict(zip(order, tokens))

    def accepted(self, seq_id: str, num_accepted: int) -> None:
        """The draft wrote positions c .. c + k - 1 (the last token, then drafts 1 .. k - 1): those of
        accepted tokens stay valid."""
        c, k = self._pending.pop(seq_id)
        self.computed[seq_id] = c + min(num_accepted, k - 1) + 1

    def drop(self, seq_id: str) -> None:
        self.computed.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if self.num_layers is None:  # copy-on-write of a shared block: the draft's copy too
            for src, dst in pairs:
                self.kv_cache[dst].copy_(self.kv_cache[src])


class Speculator:
    """The runner's side of speculative decoding: drafts for the scheduled sequences, verification,
    and the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats(config.num_speculative_tokens)

    def propose(self, runner, sched) -> dict[str, list[int]]:
        computed = sched.computed_before()
        items = [(s, runner.seqs[s], computed[s], k) for s, k in sched.num_spec_tokens.items()]
        drafts = self.proposer.propose(items)
        return {s: d for s, d in drafts.items() if d}

    def verify(self, runner, hidden: torch.Tensor, spec_rows: list[tuple[int, str, list[int]]], out) -> None:
        """Rejection-sample each speculating sequence's rows; its emitted tokens (and their logprobs)
        go into ``out`` and its runner state."""
        rows: list[int] = []
        draft_ids: list[int] = []
        batch_rows: list[tuple[object, int, int]] = []
        for first, seq_id, draft in spec_rows:
            state = runner.seqs[seq_id]
            p = state.params
            seed = sample_seed(state.seed, state.sample_index)
            for i in range(len(draft) + 1):
                rows.append(first + i)
                draft_ids.append(draft[i] if i < len(draft) else -1)
                batch_rows.append((p, seed, len(state.token_ids) + i))
        logits = runner.model.compute_logits(hidden[rows])
        dev = logits.device
        batch = SamplingBatch.for_rows(batch_rows, dev)
        verified = rejection_sample(logits, batch, torch.tensor(draft_ids, dtype=torch.int64, device=dev))
        emitted = verified.emitted.tolist()
        accepted = verified.accepted.tolist()
        want = [runner.seqs[s].params.logprobs for _, s, _ in spec_rows]
        lp = _logprobs(logits, verified.emitted, want, [len(d) + 1 for *_, d in spec_rows])
        row = 0
        for (_, seq_id, draft), k_lp in zip(spec_rows, want):
            toks = accepted_prefix(emitted, accepted, row, len(draft))
            out.sampled[seq_id] = toks
            if k_lp is not None:
                out.logprobs[seq_id] = lp[row : row + len(toks)]
            runner.seqs[seq_id].token_ids.extend(toks)
            self.proposer.accepted(seq_id, len(toks) - 1)
            self.stats.record(len(draft), len(toks) - 1)
            row += len(draft) + 1

    def drop(self, seq_id: str) -> None:
        self.proposer.drop(seq_id)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.proposer.copy_blocks(pairs)


def _logprobs(
    logits: torch.Tensor, emitted: torch.Tensor, want: list[int | None], rows_per_seq: list[int]
) -> list[dict[int, float]]:
    """Per row: {emitted token: its logprob, top-k alternatives...} (the model's own logprobs, as
    the ordinary sampler returns them); empty when no sequence wants logprobs."""
    wanted = [k for k in want if k is not None]
    if not wanted:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, emitted[:, None]).squeeze(1).tolist()
    ids = emitted.tolist()
    k_max = max(wanted)
    top_lp, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    top_lp = top_lp.tolist() if k_max else None
    top_ids = top_ids.tolist() if k_max else None
    out = []
    row = 0
    for k, n in zip(want, rows_per_seq):
        for r in range(row, row + n):
            d = {ids[r]: chosen[r]}
            for tid, v in zip((top_ids[r][:k] if k else ()), (top_lp[r][:k] if k else ())):
                d.setdefault(tid, v)
            out.append(d)
        row += n
    return out


def build_speculator(
    config: SpeculativeConfig,
    target,
    target_path: Path,
    tokenizer: str | None,
    max_model_len: int,
    load_draft,
) -> tuple[Speculator, object | None]:
    """Check the method against the target and load what it needs. Returns the speculator (its
    proposer's cache attached later by ``attach_cache``) and the draft model, if any. ``load_draft``
    loads a checkpoint directory like the target's loader."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)), None
    if config.method == "early_exit":
        if config.num_layers >= target.spec.num_layers:
            raise ValueError(
                f"early_exit num_layers ({config.num_layers}) must be fewer than the target's "
                f"{target.spec.num_layers} layers"
            )
        return Speculator(config, None), None
    from engine.models import resolve_model_path

    draft_path = resolve_model_path(config.model)
    draft = load_draft(draft_path)
    check_draft(target.spec, draft.spec, tokenizer or str(target_path), draft_path, max_model_len)
    logger.info(
        "draft model %s: %d layers, %.1fM parameters",
        draft_path,
        draft.spec.num_layers,
        sum(p.numel() for p in draft.parameters()) / 1e6,
    )
    return Speculator(config, None), draft


def attach_cache(
    spec: Speculator, target, draft, target_cache: torch.Tensor, layout: KVLayout, num_blocks: int, backend
) -> None:
    """Give a model proposer its KV cache: the draft model's own (same block ids as the target's),
    or, for early exit, the target's."""
    if spec.proposer is not None:
        return
    device = getattr(target_cache, "raw", target_cache).device  # a quantized cache's region
    if draft is None:
        spec.proposer = ModelProposer(
            target, target_cache, layout.block_size, device, backend, num_layers=spec.config.num_layers
        )
        return
    draft_layout = KVLayout.from_spec(draft.spec, layout.block_size, layout.dtype)
    cache = draft_layout.allocate(num_blocks, device)
    spec.proposer = ModelProposer(draft, cache, layout.block_size, device, backend)


def check_draft(target_spec, draft_spec, target_tokenizer: str, draft_path: Path, max_model_len: int) -> None:
    """Refuse a draft that cannot propose the target's tokens, with the reason."""
    if draft_spec.vocab_size != target_spec.vocab_size:
        raise ValueError(
            f"draft model {draft_path} has a vocabulary of {draft_spec.vocab_size} tokens but the target "
            f"has {target_spec.vocab_size}: a draft must share the target's tokenizer"
        )
    if draft_spec.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft model {draft_path} handles {draft_spec.max_position_embeddings} positions, fewer than "
            f"the engine's max_model_len of {max_model_len}: lower max_model_len"
        )
    from transformers import AutoTokenizer

    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_path)
    except (OSError, ValueError):
        logger.warning(
            "draft model %s has no tokenizer; assuming the target's (same vocabulary size)", draft_path
        )
        return
    target_tok = AutoTokenizer.from_pretrained(target_tokenizer)
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(
            f"draft model {draft_path} has a different tokenizer than the target's ({target_tokenizer}): "
            "their token ids would not mean the same text"
        )


def draft_block_bytes(draft, block_size: int, dtype: torch.dtype) -> int:
    return 0 if draft is None else KVLayout.from_spec(draft.spec, block_size, dtype).block_bytes
