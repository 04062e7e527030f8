"""Attention over the paged, block-major KV cache with the Triton kernels of ``triton_kernels``.

Per layer: ``store_kv`` writes the step's new K/V into their slots of ``kv_cache[:, layer]``; then the
first ``num_decodes`` sequences (one query token each) run the split-K decode kernel and the rest
(prefill chunks over a possibly cached prefix) the varlen prefill kernel, each writing its rows of the
output in place. ``prepare`` builds what every layer of the step shares (the prefill chunks' offsets
on the device, host-side maxima that size the grids), so a layer launches its kernels without a host
sync or copy.

Runs on CUDA tensors, and on CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.triton_kernels import paged_decode_attention, store_kv
from engine.attention.triton_prefill import paged_prefill_attention
from engine.kv_quant import QuantizedKVCache, store


@dataclass(slots=True)
class _StepPlan:
    meta: AttentionMetadata  # the step this plan was built for
    max_decode_len: int
    max_prefill_query_len: int
    # [num_prefills + 1] int64, relative to the first prefill token (None: decodes alone)
    prefill_query_start: torch.Tensor | None


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, decode_partition_size: int = 512) -> None:
        # Decode contexts longer than this are split across programs (split-K) and merged.
        self.decode_partition_size = decode_partition_size
        self._plan: _StepPlan | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        qsl = meta.query_start_loc
        # Spans are never empty, so offsets 0..nd at the first nd + 1 entries mean one token each.
        assert qsl[nd] == nd, "decodes come first, one token each"
        first = qsl[nd]
        self._plan = _StepPlan(
            meta=meta,
            max_decode_len=(
                meta.max_seq_len
                if meta.max_seq_len and nd == len(meta.seq_lens_list)
                else max(meta.seq_lens_list[:nd], default=0)
            ),
            max_prefill_query_len=max((qsl[i + 1] - qsl[i] for i in range(nd, len(qsl) - 1)), default=0),
            prefill_query_start=(
                None
                if nd == len(qsl) - 1  # decodes alone: no prefill kernel reads it
                else meta.query_start_loc_tensor[nd:] - first
                if meta.query_start_loc_tensor is not None
                else torch.tensor(
                    [s - first for s in qsl[nd:]], dtype=torch.int64, device=meta.seq_lens.device
                )
            ),
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        # NOTE: the plan holds a reference to its meta, so `is` cannot match a recycled object.
        if self._plan is None or self._plan.meta is not meta:
            self.prepare(meta)
        plan = self._plan
        if isinstance(kv_cache, QuantizedKVCache):  # quantized on write in torch, dequantized in-kernel
            store(kv_cache, layer, 0, k, meta.slot_blocks, meta.slot_offsets)
            store(kv_cache, layer, 1, v, meta.slot_blocks, meta.slot_offsets)
            k_cache, v_cache = kv_cache.data[:, layer, 0], kv_cache.data[:, layer, 1]
            scales = {"k_scales": kv_cache.scales[:, layer, 0], "v_scales": kv_cache.scales[:, layer, 1]}
        else:
            k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
            store_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
            scales = {}
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                max_seq_len=plan.max_decode_len, scale=scale, sliding_window=sliding_window,
                out=out[:nd], partition_size=self.decode_partition_size, **scales,
            )  # fmt: skip
        if plan.max_prefill_query_len:
            first = meta.query_start_loc[nd]
            paged_prefill_attention(
                q[first:], k_cache, v_cache, meta.block_tables[nd:], plan.prefill_query_start,
                meta.seq_lens[nd:], max_query_len=plan.max_prefill_query_len, scale=scale,
                sliding_window=sliding_window, out=out[first:], **scales,
            )  # fmt: skip
        return out
