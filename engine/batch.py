"""One flattened (varlen) forward batch over paged KV: tokens, positions, slots, block tables.

A span is (token ids, first position, block table): its tokens take positions ``start`` onwards,
write their K/V into the slots the table maps those positions to, and attend over everything before
them. Spans of one token (decodes) must come first; the target's steps and the draft's passes both
build their batches here.
"""

from __future__ import annotations

import array
import itertools

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata

Span = tuple[list[int], int, list[int]]


def build_batch(
    spans: list[Span], block_size: int, device: torch.device, backend: AttentionBackend
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, attention metadata) of ``spans``; ``meta.query_start_loc[i + 1] - 1``
    is the flat row of span ``i``'s last token."""
    bs = block_size
    tokens: list[int] = []
    pos: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    num_decodes = 0
    for toks, start, _ in spans:
        n = len(toks)
        end = start + n
        tokens.extend(toks)
        pos.extend(range(start, end))
        seq_lens.append(end)
        qsl.append(qsl[-1] + n)
        if n == 1 and num_decodes == len(seq_lens) - 1:
            num_decodes += 1
    max_blocks = max(-(-s // bs) for s in seq_lens)
    # NOTE: one buffer for the padded tables, filled row by row from the lists and viewed as a
    # tensor: a tensor per row (the obvious way) costs 2.3x as much at 256 sequences x 4k tokens,
    # where this is the host's largest item of a decode step (bench/README.md, GPU).
    flat = array.array("q")
    for (_, _, block_ids), n_tokens in zip(spans, seq_lens):
        ids = block_ids[: -(-n_tokens // bs)]
        flat.extend(ids)
        if len(ids) < max_blocks:
            flat.extend(itertools.repeat(0, max_blocks - len(ids)))
    tables = torch.frombuffer(flat, dtype=torch.int64).view(len(spans), max_blocks)
    pos_t = torch.tensor(pos, dtype=torch.int64)
    q_seq = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(qsl[1:]) - torch.tensor(qsl[:-1]))
    slot_blocks = tables[q_seq, pos_t // bs]
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        slot_blocks=slot_blocks.to(device),
        slot_offsets=(pos_t % bs).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_list=seq_lens,
        query_start_loc=qsl,
        block_tables=tables.to(device),
        block_size=bs,
    )
    backend.prepare(meta)
    input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    return input_ids, pos_t.to(device), meta
