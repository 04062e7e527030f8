"""Reference attention in plain torch: runs anywhere, the oracle for the Triton kernels.

Decodes are batched: their block tables gather K/V into a padded [D, kv_heads, ctx, head_dim]
tensor and one SDPA call serves a group of them, with the query heads of a KV head grouped on the
query axis (GQA without repeating K/V). Decodes arrive sorted by context length and are split into
groups whose lengths differ by at most ``1 / GROUP_RATIO``, so padding costs little memory traffic
(the step is memory-bound on CPU). Prefill chunks run one SDPA each, causal over the prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata, DecodeGroup
from engine.kv_quant import QuantizedKVCache, gather, store

GROUP_RATIO = 0.75


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        lens = meta.seq_lens_list[: meta.num_decodes]
        groups: list[DecodeGroup] = []
        meta.decode_groups = groups
        if not lens:
            return
        bs = meta.block_size
        # One key mask for every decode, as wide as the longest; each group takes a view of its rows
        # and width (a step whose lengths vary, as requests come and go, has several groups).
        keys = torch.arange(-(-max(lens) // bs) * bs, device=meta.seq_lens.device)
        masks = keys < meta.seq_lens[: len(lens), None]
        start = 0
        for i in range(1, len(lens) + 1):
            if i == len(lens) or lens[i] < GROUP_RATIO * lens[start]:
                nb = -(-max(lens[start:i]) // bs)
                groups.append(DecodeGroup(start, i, nb, masks[start:i, : nb * bs].view(i - start, 1, 1, -1)))
                start = i

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
        if isinstance(kv_cache, QuantizedKVCache):
            store(kv_cache, layer, 0, k, meta.slot_blocks, meta.slot_offsets)
            store(kv_cache, layer, 1, v, meta.slot_blocks, meta.slot_offsets)
            k_cache = _Dequantized(kv_cache, layer, 0, q.dtype)
            v_cache = _Dequantized(kv_cache, layer, 1, q.dtype)
        else:
            k_cache = kv_cache[:, layer, 0]
            v_cache = kv_cache[:, layer, 1]
            k_cache[meta.slot_blocks, meta.slot_offsets] = k
            v_cache[meta.slot_blocks, meta.slot_offsets] = v
        out = torch.empty_like(q)
        for g in meta.decode_groups or ():
            out[g.start : g.end] = self._decode(
                q[g.start : g.end], k_cache, v_cache, meta, g, scale, sliding_window
            )
        for i in range(meta.num_decodes, len(meta.seq_lens_list)):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q[start:end], k_cache, v_cache, meta, i, scale, sliding_window)
        return out

    def _decode(self, q, k_cache, v_cache, meta, group: DecodeGroup, scale, sliding_window):
        d, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[-2]
        mask = group.key_mask
        tables = meta.block_tables[group.start : group.end, : group.num_blocks].reshape(-1)
        # [D * nb, bs, kvh, hd] -> [D, kvh, ctx, hd]. NOTE: index_select is ~6x faster than advanced
        # indexing for this strided block gather on CPU.
        keys = k_cache.index_select(0, tables).view(d, -1, num_kv, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, tables).view(d, -1, num_kv, head_dim).transpose(1, 2)
        if sliding_window is not None:
            pos = torch.arange(mask.shape[-1])
            first = (meta.seq_lens[group.start : group.end] - sliding_window).view(d, 1, 1, 1)
            mask = mask & (pos.view(1, 1, 1, -1) >= first)
        qg = q.view(d, num_kv, num_heads // num_kv, head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(d, num_heads, head_dim)

    def _prefill(self, q, k_cache, v_cache, meta, i, scale, sliding_window):
        n, num_heads, _ = q.shape
        ctx = meta.seq_lens_list[i]
        nb = -(-ctx // meta.block_size)
        table = meta.block_tables[i, :nb]
        keys = k_cache.index_select(0, table).flatten(0, 1)[:ctx].transpose(0, 1)  # [kvh, ctx, hd]
        values = v_cache.index_select(0, table).flatten(0, 1)[:ctx].transpose(0, 1)
        group = num_heads // keys.shape[0]
        if group > 1:
            keys = keys.repeat_interleave(group, dim=0)
            values = values.repeat_interleave(group, dim=0)
        qh = q.transpose(0, 1)  # [H, n, hd]
        start = ctx - n
        if start == 0 and sliding_window is None:
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale)
        else:
            qpos = torch.arange(start, ctx).view(-1, 1)
            kpos = torch.arange(ctx).view(1, -1)
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale)
        return out.transpose(0, 1)


class _Dequantized:
    """One layer's K or V of a quantized cache, dequantized block by block as they are gathered
    (the only access the attention paths above make: ``index_select(0, block_ids)`` and the shape)."""

    def __init__(self, cache: QuantizedKVCache, layer: int, kv: int, dtype: torch.dtype) -> None:
        self.cache, self.layer, self.kv, self.dtype = cache, layer, kv, dtype
        self.shape = cache.data.shape[:1] + cache.data.shape[3:]  # [blocks, bs, kvh, hd]

    def index_select(self, dim: int, block_ids: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        return gather(self.cache, self.layer, self.kv, block_ids, self.dtype)
