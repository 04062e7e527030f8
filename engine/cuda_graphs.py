"""CUDA graphs for the decode step: the forward pass of a pure-decode batch replayed from a graph.

A decode step launches a few kernels per layer for a handful of tokens, so on a GPU its time is
mostly launch overhead; a CUDA graph replays the whole forward in one launch. Graphs need static
shapes and addresses, so the runner keeps static input buffers for the largest batch and captures one
graph per batch-size bucket (1, 2, 4, 8, then multiples of 8 up to ``max_batch``); a batch of B runs
the graph of the smallest bucket >= B with the rows past B padded: their token is 0, their context
one token long, and their K/V is written to a pad block that the block pool never hands out (the
KV tensor's last block), so padding cannot touch a real sequence. The attention grid is sized for
``max_model_len``, so one graph serves every context length (the kernels mask past each row's
length).

Mixed steps (``mixed``, on by default) replay the same graphs. A prompt chunk's token at position
``p`` attends to its sequence's keys ``0 .. p`` (all of them written to the cache by the layer's
store before any row attends), which is what a decode row with context length ``p + 1`` and its
sequence's block table computes: so a step of T tokens, decodes and prompt chunks mixed, runs as T
decode rows, each with its own context length (``positions + 1``) and its sequence's table row,
gathered on the device. A step qualifies when T fits the largest bucket and its prompt tokens'
contexts add up to at most ``mixed_budget`` keys (each row reads its own context, where the prefill
kernel reads it once per tile of queries; past the budget the step runs eagerly). On a GPU an eager
step launches every kernel of every layer from Python, several times the host time of a replay:
a served engine, whose requests arrive one by one, runs such steps all the time.

With LoRA adapters (``lora``: the engine's ``LoraSlots``), the graphs also capture the adapters'
update, from per-token kernels (``engine.lora.kernels.lora_update_per_token``) that read each row's
slot from a static buffer: a step of any mix of adapters and the base model replays the same graph,
its slots copied in first (-1 for the base model and padding rows). The slots' weights stay at fixed
addresses (an adapter is copied into its slot in place), so swapping adapters needs no recapture.

With ``capture=False`` the same static-buffer path runs eagerly: that is how CPU tests (Triton under
its interpreter) check the padding and buffers against the plain path, token for token.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionMetadata
from engine.config import EngineConfig
from engine.lora.batch import GraphLora

logger = logging.getLogger(__name__)

# The most (prompt token, context token) pairs a mixed step's prompt chunks may attend to and still
# replay a graph: 256 prompt tokens over 2k contexts each. Each pair is a key read per row that a
# prefill kernel would share across a tile of queries; below this the reads should cost less than
# launching the step eagerly costs the host. An estimate, not yet measured on a GPU: bench.gpu_bench
# times a 128-token turn over a cached 3,840-token prefix (508k pairs) replayed and eager.
MIXED_BUDGET = 256 * 2048


def graphs_apply(config: EngineConfig, device_type: str, backend: str, kv_dtype, model) -> bool:
    """Whether an engine captures decode CUDA graphs: asked for, on a GPU, with the Triton backend;
    not with a quantized KV cache (its store, a scale per token since, no longer groups writes
    with ``torch.unique``; replaying it waits for a GPU to check), nor for an emulated accelerator (``zero_cost.StepTime``: it waits in its forward,
    which a replay would skip)."""
    if not (config.cuda_graphs and device_type == "cuda" and backend == "triton"):
        return False
    if kv_dtype is not None:
        logger.info("kv_cache_dtype=%s: decode steps run eagerly (no CUDA graphs)", config.kv_cache_dtype)
        return False
    if getattr(model, "step_time", None) is not None:
        logger.info("an emulated accelerator: steps run eagerly (a graph replay would skip its wait)")
        return False
    return True


def graph_max_batch(config: EngineConfig) -> int:
    """The most rows a step can bring to a graph (``EngineConfig``): its tokens when mixed steps
    replay too, its sequences otherwise; never more than ``cuda_graph_max_batch``."""
    rows = config.max_num_batched_tokens
    if not config.cuda_graph_mixed:
        rows = min(rows, config.max_num_seqs)
    return min(config.cuda_graph_max_batch, rows)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, and ``max_batch`` itself: a padded batch wastes < 8 rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


class DecodeGraphRunner:
    def __init__(
        self,
        model,
        backend,
        kv_cache_with_pad: torch.Tensor,  # [num_blocks + 1, ...]; the last block is the pad block
        block_size: int,
        max_model_len: int,
        max_batch: int,
        capture: bool = True,
        lora=None,
        mixed: bool = True,
        mixed_budget: int = MIXED_BUDGET,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache_with_pad
        self.pad_block = kv_cache_with_pad.shape[0] - 1
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.capture = capture
        self.mixed = mixed
        self.mixed_budget = mixed_budget
        dev = kv_cache_with_pad.device
        n, width = self.max_batch, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_blocks = torch.full((n,), self.pad_block, dtype=torch.int64, device=dev)
        self.slot_offsets = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((n, width), self.pad_block, dtype=torch.int64, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)  # a mixed step's token indices
        self._written = 0  # rows below hold a replayed step's inputs; the rest, padding
        self.lora = lora
        self.lora_slots = torch.full((n,), -1, dtype=torch.int64, device=dev) if lora is not None else None
        self._metas = {b: self._static_meta(b) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _static_meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=b,
            slot_blocks=self.slot_blocks[:b],
            slot_offsets=self.slot_offsets[:b],
            seq_lens=self.seq_lens[:b],
            seq_lens_list=[self.max_model_len] * b,  # sizes the attention grid for any context
            query_start_loc=list(range(b + 1)),
            block_tables=self.block_tables[:b],
            block_size=self.block_size,
            lora=GraphLora(self.lora, self.lora_slots[:b]) if self.lora is not None else None,
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether the step's tokens fit a graph: a pure-decode batch of at most ``max_batch``, or
        (``mixed``) a step of at most ``max_batch`` tokens whose prompt chunks stay in the budget."""
        too_wide = meta.block_tables.shape[1] > self.block_tables.shape[1]
        if too_wide or (meta.lora is not None and self.lora is None):
            return False
        nd, b = meta.num_decodes, len(meta.seq_lens_list)
        if nd == b:
            return 0 < b <= self.max_batch
        qsl, lens = meta.query_start_loc, meta.seq_lens_list
        if not self.mixed or qsl[-1] > self.max_batch or meta.query_start_loc_tensor is None:
            return False  # (each token's span is found from the span offsets the upload carries)
        return sum((qsl[i + 1] - qsl[i]) * lens[i] for i in range(nd, b)) <= self.mixed_budget

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [T, hidden] of the step's T tokens, each run as a decode row."""
        b = meta.query_start_loc[-1]  # rows: one per token
        bucket = next(x for x in self.buckets if x >= b)
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_blocks[:b].copy_(meta.slot_blocks)
        self.slot_offsets[:b].copy_(meta.slot_offsets)
        if meta.num_decodes == len(meta.seq_lens_list):
            self.seq_lens[:b].copy_(meta.seq_lens)
            self.block_tables[:b, :width].copy_(meta.block_tables)
        else:  # each token sees its sequence's context up to itself
            torch.add(positions, 1, out=self.seq_lens[:b])
            self.block_tables[:b, :width].copy_(meta.block_tables.index_select(0, self._token_spans(meta, b)))
        self.block_tables[:b, width:].fill_(self.pad_block)
        if self.lora_slots is not None:
            if meta.lora is None:
                self.lora_slots[:b].fill_(-1)
            else:
                self.lora_slots[:b].copy_(meta.lora.token_slots)
        # NOTE: a padding row holding an earlier row's inputs would write its K/V into that row's
        # slot. Rows at and past ``_written`` are padding; those an earlier, larger step wrote go
        # back to padding, all of them, so that one bound keeps track (a steady batch resets none).
        end = self._written
        if end > b:
            self.input_ids[b:end].zero_()
            self.positions[b:end].zero_()
            self.slot_blocks[b:end].fill_(self.pad_block)
            self.slot_offsets[b:end].zero_()
            self.seq_lens[b:end].fill_(1)
            self.block_tables[b:end].fill_(self.pad_block)
            if self.lora_slots is not None:
                self.lora_slots[b:end].fill_(-1)
        self._written = b
        if self.capture:
            self._graphs[bucket].replay()
            return self._outputs[bucket][:b]
        return self._forward(bucket)[:b]

    def _token_spans(self, meta: AttentionMetadata, n: int) -> torch.Tensor:
        """Each of a mixed step's ``n`` tokens' span (its sequence's row in ``meta.block_tables``),
        found on the device from the step's span offsets."""
        return torch.searchsorted(meta.query_start_loc_tensor[1:], self.rows[:n], right=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = self._metas[bucket]
        self.backend.prepare(meta)  # host-side plan only: nothing to record
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its pool
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.backend.prepare(self._metas[bucket])
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self.model(
                    self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, self._metas[bucket]
                )
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %s rows (decodes%s)",
            self.buckets,
            f", and mixed steps of up to {self.max_batch} tokens" if self.mixed else "",
        )
