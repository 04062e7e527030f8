"""Reference attention in plain torch: runs anywhere, the oracle for the Triton kernels.

Decodes are batched: their block tables gather K/V into a padded [D, kv_heads, ctx, head_dim]
tensor and one SDPA call serves all of them, with the query heads of a KV head grouped on the
query axis (GQA without repeating K/V). Prefill chunks run one SDPA each, causal over the prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        d = meta.num_decodes
        if d == 0:
            return
        ctx = int(max(meta.seq_lens_list[:d]))
        nb = -(-ctx // meta.block_size)
        pos = torch.arange(nb * meta.block_size)
        meta.decode_key_mask = (pos[None, :] < meta.seq_lens[:d, None]).view(d, 1, 1, -1)

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
        k_cache = kv_cache[:, layer, 0]
        v_cache = kv_cache[:, layer, 1]
        k_cache[meta.slot_blocks, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, meta.slot_offsets] = v
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale, sliding_window)
        for i in range(d, len(meta.seq_lens_list)):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q[start:end], k_cache, v_cache, meta, i, scale, sliding_window)
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, sliding_window):
        d, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[-2]
        mask = meta.decode_key_mask
        nb = mask.shape[-1] // meta.block_size
        tables = meta.block_tables[:d, :nb]
        # [D, nb, bs, kvh, hd] -> [D, kvh, ctx, hd]
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
        values = v_cache[tables].flatten(1, 2).transpose(1, 2)
        if sliding_window is not None:
            pos = torch.arange(mask.shape[-1])
            first = (meta.seq_lens[:d] - sliding_window).view(d, 1, 1, 1)
            mask = mask & (pos.view(1, 1, 1, -1) >= first)
        qg = q.view(d, num_kv, num_heads // num_kv, head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(d, num_heads, head_dim)

    def _prefill(self, q, k_cache, v_cache, meta, i, scale, sliding_window):
        n, num_heads, _ = q.shape
        ctx = meta.seq_lens_list[i]
        nb = -(-ctx // meta.block_size)
        table = meta.block_tables[i, :nb]
        keys = k_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)  # [kvh, ctx, hd]
        values = v_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)
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
