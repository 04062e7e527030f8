"""The persistent batch: device block tables changed by deltas, one packed upload per step.

Checked against ``engine.batch.build_batch`` (which rebuilds everything from lists each step): the
slots a step writes, the context lengths and every block a span attends must agree after any mix
of new sequences, appended blocks, copy-on-write rewrites and finished sequences whose rows are
reused. The GPU's path (writes queued, then applied on the device from the upload) runs on CPU by
treating the table as a device table.
"""

from __future__ import annotations

import array
import random

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.batch import build_batch
from engine.persistent_batch import (
    BlockTables,
    SampleGather,
    SamplingScalars,
    StepUploader,
    build_step_inputs,
)

BS = 4


class _CountingUploader(StepUploader):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.sizes: list[int] = []

    def upload(self, packed: array.array) -> torch.Tensor:
        self.sizes.append(len(packed))
        return super().upload(packed)


def _tables() -> BlockTables:
    return BlockTables(64, torch.device("cpu"), rows=2)  # 2 rows: growth is exercised too


def _check_step(tables, uploader, seqs: dict[str, tuple[list[int], list[int]]], rng) -> None:
    """One step over every live sequence: decodes first, then chunks of 1-5 tokens."""
    ids = sorted(seqs)
    decodes = [s for s in ids if rng.random() < 0.6]
    spans_new, spans_ref = [], []
    for seq_id in decodes + [s for s in ids if s not in decodes]:
        toks_all, blocks = seqs[seq_id]
        n = 1 if seq_id in decodes else rng.randint(2, 5)
        start = len(toks_all) - n
        toks = toks_all[start:]
        spans_new.append((toks, start, seq_id))
        spans_ref.append((toks, start, blocks))
    backend = TorchAttentionBackend()
    got = build_step_inputs(spans_new, tables, uploader, BS, backend, None)
    ref_ids, ref_pos, ref = build_batch(spans_ref, BS, torch.device("cpu"), backend)
    assert torch.equal(got.input_ids, ref_ids) and torch.equal(got.positions, ref_pos)
    assert torch.equal(got.meta.slot_blocks, ref.slot_blocks)
    assert torch.equal(got.meta.slot_offsets, ref.slot_offsets)
    assert torch.equal(got.meta.seq_lens, ref.seq_lens)
    assert got.meta.query_start_loc == ref.query_start_loc
    assert got.meta.query_start_loc_tensor.tolist() == ref.query_start_loc
    assert got.meta.num_decodes == ref.num_decodes
    for i, n in enumerate(ref.seq_lens_list):
        used = -(-n // BS)
        assert torch.equal(got.meta.block_tables[i, :used], ref.block_tables[i, :used])


def test_tables_follow_the_deltas_like_a_rebuilt_batch():
    rng = random.Random(7)
    tables, uploader = _tables(), _CountingUploader()
    seqs: dict[str, tuple[list[int], list[int]]] = {}
    next_block = iter(range(10_000))
    for step in range(60):
        if len(seqs) < 6 and rng.random() < 0.5:  # a new sequence with its prompt's blocks
            n = rng.randint(2, 30)
            blocks = [next(next_block) for _ in range(-(-n // BS))]
            seqs[f"s{step}"] = ([rng.randrange(100) for _ in range(n)], blocks)
            tables.add(f"s{step}", blocks)
        for seq_id, (toks, blocks) in list(seqs.items()):
            r = rng.random()
            if r < 0.1:  # finished: its row goes back to be reused
                del seqs[seq_id]
                tables.remove(seq_id)
                continue
            if r < 0.15:  # copy-on-write: a block in the middle changed
                blocks[rng.randrange(len(blocks))] = next(next_block)
                tables.replace(seq_id, blocks)
            toks.append(rng.randrange(100))
            if len(toks) > len(blocks) * BS:  # crossed a block boundary
                blocks.append(next(next_block))
                tables.append(seq_id, [blocks[-1]])
        if seqs:
            _check_step(tables, uploader, seqs, rng)
    assert len(uploader.sizes) > 40  # one upload per step


def test_a_decode_steps_upload_does_not_grow_with_context():
    """256 decoding sequences at 128 or 4096 tokens: the same upload, bar the blocks just crossed."""
    sizes = {}
    for context in (128, 4096):
        tables, uploader = _tables(), _CountingUploader()
        tables.width = 4096 // BS + 8
        tables.table = torch.zeros((256, tables.width), dtype=torch.int64)
        tables._free = list(range(255, -1, -1))
        tables._len = [0] * 256
        spans = []
        for i in range(256):
            tables.add(f"s{i}", list(range(-(-context // BS))))
            spans.append(([1], context - 1, f"s{i}"))
        build_step_inputs(spans, tables, uploader, BS, TorchAttentionBackend(), None)  # the prompts' writes
        build_step_inputs(spans, tables, uploader, BS, TorchAttentionBackend(), None)  # a plain decode step
        sizes[context] = uploader.sizes[-1]
    assert sizes[128] == sizes[4096] == 3 * 256 + 3 * 256 + 1


def test_sampling_scalars_ride_in_the_same_upload():
    tables, uploader = _tables(), _CountingUploader()
    tables.add("a", [3])
    tables.add("b", [5])
    scalars = SamplingScalars([0.7, 0.0], [0, 5], [0.9, 1.0], [0.0, 0.05], [2**62 + 3, 11], [3, 4])
    got = build_step_inputs(
        [([1], 2, "a"), ([2], 3, "b")], tables, uploader, BS, TorchAttentionBackend(), scalars
    )
    assert len(uploader.sizes) == 1
    s = got.sampling
    assert (
        torch.allclose(s["temperature"], torch.tensor([0.7, 0.0])) and s["temperature"].dtype == torch.float32
    )
    assert s["top_k"].tolist() == [0, 5] and s["seeds"].tolist() == [2**62 + 3, 11]
    assert torch.allclose(s["top_p"], torch.tensor([0.9, 1.0])) and torch.allclose(
        s["min_p"], torch.tensor([0.0, 0.05])
    )
    assert s["positions"].tolist() == [3, 4]


def test_sampling_parameters_are_stored_once_and_gathered_for_the_rows_that_sample():
    """Set when a sequence arrives (the GPU's way: a pending write in the next upload), then each
    step uploads only which rows sample: the device gathers their parameters, and a sampled token's
    position is its span's context length."""
    tables, uploader = _tables(), _CountingUploader()
    for i, seq_id in enumerate(("a", "b", "c")):
        tables.add(seq_id, [10 + i])
        tables.set_sampling(seq_id, 0.5 + i, i, 0.9 - 0.1 * i, 0.01 * i, 2**62 + i)
    spans = [([1], 2, "a"), ([2], 3, "c"), ([4, 5], 0, "b")]
    gather = SampleGather([tables.row_of["c"], tables.row_of["b"]], [1, 2])  # a's row does not sample
    got = build_step_inputs(spans, tables, uploader, BS, TorchAttentionBackend(), gather)
    s = got.sampling
    assert torch.allclose(s["temperature"], torch.tensor([2.5, 1.5])) and s["top_k"].tolist() == [2, 1]
    assert torch.allclose(s["top_p"], torch.tensor([0.7, 0.8])) and torch.allclose(
        s["min_p"], torch.tensor([0.02, 0.01])
    )
    assert s["seeds"].tolist() == [2**62 + 2, 2**62 + 1]
    assert s["positions"].tolist() == [4, 2]  # c: context 3 + 1 token; b: 0 + 2 tokens
    assert len(uploader.sizes) == 1
