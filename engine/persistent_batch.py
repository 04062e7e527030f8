"""The runner's batch state kept across steps: block tables on the device, one upload per step.

Each sequence the runner knows owns a row of a ``[rows, max_blocks_per_seq]`` block table that
lives on the engine's device. The table changes only where the scheduler says it does: a new
sequence writes its row once, a sequence that crosses a block boundary appends one id, a
copy-on-write rewrites its row; nothing is rebuilt from Python lists each step. Each row also
stores its sequence's sampling parameters (temperature, top-k, top-p, min-p, seed), written once
when the sequence arrives. A step's inputs (token ids, positions, which row each token and span
reads, context lengths, query offsets, the pending table and parameter writes, and which rows
sample) are packed into one int64 buffer on the host and
cross to the device in one copy (pinned, asynchronous, double-buffered so that preparing step N+1
never overwrites what step N's copy still reads). The device then applies the table writes and
derives the slot mapping and the span's block tables itself.

Host work per step is therefore O(tokens + new blocks), not O(batch x context): a 256 x 4k decode
step no longer writes 66k block ids. On a CPU engine the "device" table is the host table; its
writes wait for the step's upload too, and land in one indexed assignment (one per sequence cost
~5 us each, and a step where 256 sequences cross a block boundary paid it 256 times). A steady
decode batch skips even the upload: its inputs are advanced on the device from the step before
(``engine.repeat_inputs``).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata

PARAMS = 5  # a row's sampling parameters in ``BlockTables.params``


class BlockTables:
    """Block tables of the runner's sequences, a row each, mirrored on the device."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, rows: int = 64) -> None:
        self.width = max_blocks_per_seq
        self.device = device
        self.table = torch.zeros((rows, self.width), dtype=torch.int64, device=device)
        self.row_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self._len: list[int] = [0] * rows
        # Writes the table has not seen yet (the next ``upload_step`` applies them at once): rows,
        # columns, block ids.
        self.pending = (array.array("q"), array.array("q"), array.array("q"))
        # Each row's sampling parameters, written once per sequence, in one int64 table (one write
        # per step that adds sequences): temperature, top-p and min-p as float64 bits, top-k, seed.
        # Pending as the writes are: rows, and their 5 values each.
        self.params = torch.zeros((rows, PARAMS), dtype=torch.int64, device=device)
        self.pending_params = (array.array("q"), array.array("q"))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, seq_id: str, block_ids: list[int]) -> None:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.row_of[seq_id] = row
        self._len[row] = 0
        self._write(row, 0, block_ids)

    def append(self, seq_id: str, block_ids: list[int]) -> None:
        if block_ids:
            row = self.row_of[seq_id]
            self._write(row, self._len[row], block_ids)

    def append_each(self, blocks: dict[str, int]) -> None:
        """One block id appended to each sequence's row: ``blocks[seq_id]`` (a step's decodes that
        open a block)."""
        rows = [self.row_of[s] for s in blocks]
        lens = self._len
        cols = [lens[r] for r in rows]
        if max(cols) >= self.width:
            raise ValueError(f"a sequence of {max(cols) + 1} blocks exceeds the table's {self.width}")
        for r in rows:
            lens[r] += 1
        pending_rows, pending_cols, pending_ids = self.pending
        pending_rows.extend(rows)
        pending_cols.extend(cols)
        pending_ids.extend(blocks.values())

    def replace(self, seq_id: str, block_ids: list[int]) -> None:
        self._write(self.row_of[seq_id], 0, block_ids)

    def set_sampling(
        self, seq_id: str, temperature: float, top_k: int, top_p: float, min_p: float, seed: int
    ) -> None:
        """The row's sampling parameters (``upload_step`` gathers them for the rows that sample)."""
        row = self.row_of[seq_id]
        rows, values = self.pending_params
        rows.append(row)
        values.frombytes(array.array("d", (temperature, top_p, min_p)).tobytes())
        values.extend((top_k, seed))

    def remove(self, seq_id: str) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def _write(self, row: int, col: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        if col + n > self.width:
            raise ValueError(f"a sequence of {col + n} blocks exceeds the table's {self.width}")
        self._len[row] = col + n
        rows, cols, ids = self.pending
        rows.extend([row] * n)
        cols.extend(range(col, col + n))
        ids.extend(block_ids)

    def _grow(self) -> None:
        old = self.table.shape[0]
        bigger = torch.zeros((2 * old, self.width), dtype=torch.int64, device=self.device)
        bigger[:old] = self.table
        self.table = bigger
        params = torch.zeros((2 * old, PARAMS), dtype=torch.int64, device=self.device)
        params[:old] = self.params
        self.params = params
        self._free = list(range(2 * old - 1, old - 1, -1))
        self._len.extend([0] * old)

    def take_pending(self) -> tuple[array.array, array.array, array.array] | None:
        rows, _, _ = self.pending
        if not rows:
            return None
        out = self.pending
        self.pending = (array.array("q"), array.array("q"), array.array("q"))
        return out

    def take_pending_params(self) -> tuple[array.array, array.array] | None:
        if not self.pending_params[0]:
            return None
        out = self.pending_params
        self.pending_params = (array.array("q"), array.array("q"))
        return out


def sampling_columns(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``BlockTables.params`` as (floats [n, 3]: temperature, top-p, min-p, in float32;
    ints [n, 2]: top-k, seed)."""
    return params[:, :3].view(torch.float64).float(), params[:, 3:]


@dataclass(slots=True)
class SamplingScalars:
    """Per sampled row: temperature, top-k, top-p, min-p, seed and the position being sampled."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]
    positions: list[int]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sampling: dict[str, torch.Tensor] | None  # SamplingScalars' fields as device tensors
    span_rows: torch.Tensor | None = None  # each span's table row, on the device
    sample_index: torch.Tensor | None = None  # the flat rows that sample, when they do not lead


class StepUploader:
    """Packs a step's host-side integers into one buffer and sends it to the device in one copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0

    def upload(self, packed: array.array) -> torch.Tensor:
        host = (
            torch.frombuffer(packed, dtype=torch.int64) if len(packed) else torch.empty(0, dtype=torch.int64)
        )
        if not self.pinned:
            return host  # a CPU engine reads the host buffer itself (the caller keeps ``packed`` alive)
        staging = self._staging(len(packed))
        staging[: len(packed)].copy_(host)
        out = staging[: len(packed)].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._slots[self._turn] = (staging, event)
        return out

    def _staging(self, n: int) -> torch.Tensor:
        """A pinned buffer of >= n int64 that no copy in flight reads (two take turns)."""
        if not self._slots:
            self._slots = [
                (torch.empty(0, dtype=torch.int64), None),
                (torch.empty(0, dtype=torch.int64), None),
            ]
        self._turn ^= 1
        buf, event = self._slots[self._turn]
        if event is not None:
            event.synchronize()  # the copy two steps back: long done unless the GPU is far behind
        if buf.numel() < n:
            buf = torch.empty(max(n, 2 * buf.numel(), 4096), dtype=torch.int64, pin_memory=True)
        return buf


@dataclass(slots=True)
class FlatBatch:
    """A step's spans flattened on the host: the integers ``upload_step`` sends."""

    tokens: array.array = field(default_factory=lambda: array.array("q"))
    positions: array.array = field(default_factory=lambda: array.array("q"))
    token_rows: array.array = field(default_factory=lambda: array.array("q"))  # each token's table row
    span_rows: array.array = field(default_factory=lambda: array.array("q"))
    seq_lens: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    num_decodes: int = 0

    def add(self, toks: list[int], start: int, row: int) -> None:
        """One span; spans of one token (decodes) must come first."""
        n = len(toks)
        self.tokens.extend(toks)
        self.span_rows.append(row)
        self.seq_lens.append(start + n)
        self.query_start_loc.append(self.query_start_loc[-1] + n)
        if n == 1:
            self.positions.append(start)
            self.token_rows.append(row)
            if self.num_decodes == len(self.seq_lens) - 1:
                self.num_decodes += 1
        else:
            self.positions.extend(range(start, start + n))
            self.token_rows.extend([row] * n)


def build_step_inputs(
    spans: list[tuple[list[int], int, str]],
    tables: BlockTables,
    uploader: StepUploader,
    block_size: int,
    backend: AttentionBackend,
    sampling: SamplingScalars | None,
    patches: tuple[list[int], list[int], torch.Tensor] | None = None,
) -> StepInputs:
    """Inputs of one forward over ``spans`` = (token ids, first position, sequence id), decodes
    (spans of one token) first; ``meta.query_start_loc[i + 1] - 1`` is span ``i``'s last row."""
    flat = FlatBatch()
    row_of = tables.row_of
    for toks, start, seq_id in spans:
        flat.add(toks, start, row_of[seq_id])
    return upload_step(flat, tables, uploader, block_size, backend, sampling, patches)


@dataclass(slots=True)
class SampleGather:
    """The rows that sample, when each samples once from its own sequence's stored parameters:
    their table rows, and their spans (a sampled token's position is its span's context length)."""

    rows: list[int]
    spans: list[int]


def upload_step(
    flat: FlatBatch,
    tables: BlockTables,
    uploader: StepUploader,
    block_size: int,
    backend: AttentionBackend,
    sampling: SamplingScalars | SampleGather | None,
    patches: tuple[list[int], list[int], torch.Tensor] | None = None,
    sample_index: array.array | None = None,
) -> StepInputs:
    """``flat``, the tables' pending writes and the sampling inputs in one upload; the device
    derives the slot mapping, the spans' block tables and (``SampleGather``) the sampling
    parameters from the rows'. ``patches`` = (rows, indices, ids): input row ``rows[j]`` is
    ``ids[indices[j]]``, a token the previous step sampled on the device (overlapped
    scheduling), read there without a sync. ``sample_index``: the flat rows whose hidden states
    sample, sent along when they are not rows 0 .. n-1 (a step with a prompt in it), so that picking
    them is a device op rather than a copy that waits for the forward (``engine.device_copy``)."""
    seq_lens, qsl, num_decodes = flat.seq_lens, flat.query_start_loc, flat.num_decodes
    # The sections a step has, in order (NOTE: every step; a decode step's optional ones are empty
    # and neither packed nor sliced): float64 bits travel in int64 slots.
    parts: list = [flat.tokens, flat.positions, flat.token_rows, flat.span_rows, seq_lens, qsl]
    writes = tables.take_pending()
    if writes:
        parts.extend(writes)
    params = tables.take_pending_params()
    if params:
        parts.extend(params)
    if isinstance(sampling, SamplingScalars):
        parts.extend(
            _bits(array.array("d", f)) for f in (sampling.temperature, sampling.top_p, sampling.min_p)
        )
        parts.extend((sampling.top_k, sampling.seeds, sampling.positions))
    elif isinstance(sampling, SampleGather):
        parts.extend((sampling.rows, sampling.spans))
    if patches:
        parts.extend((patches[0], patches[1]))
    if sample_index is not None:
        parts.append(sample_index)
    packed = array.array("q")
    sizes: list[int] = []
    for part in parts:
        packed.extend(part)
        sizes.append(len(part))
    sections = list(uploader.upload(packed).split(sizes))  # every section's view in one call
    sections.reverse()
    take = sections.pop
    input_ids, positions, tok_rows_d, rows_d, seq_lens_d, qsl_d = (take() for _ in range(6))
    table = tables.table
    if writes:
        w_rows, w_cols, w_ids = take(), take(), take()
        table[w_rows, w_cols] = w_ids
    if params:
        p_rows, p_values = take(), take()
        tables.params[p_rows] = p_values.view(-1, PARAMS)
    max_len = max(seq_lens)
    width = -(-max_len // block_size)
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        slot_blocks=table[tok_rows_d, positions.div(block_size, rounding_mode="floor")],
        slot_offsets=positions % block_size,
        seq_lens=seq_lens_d,
        seq_lens_list=seq_lens,
        query_start_loc=qsl,
        block_tables=table[:, :width].index_select(0, rows_d),  # 3x advanced indexing's speed on CPU
        block_size=block_size,
        query_start_loc_tensor=qsl_d,
        max_seq_len=max_len,
    )
    backend.prepare(meta)
    out_sampling = None
    if isinstance(sampling, SamplingScalars):
        temperature, top_p, min_p = (take().view(torch.float64).float() for _ in range(3))
        top_k, seeds, sample_pos = take(), take(), take()
        out_sampling = dict(
            temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, seeds=seeds, positions=sample_pos
        )
    elif isinstance(sampling, SampleGather):
        rows_s, spans_s = take(), take()
        f, i = sampling_columns(tables.params[rows_s])
        out_sampling = dict(
            temperature=f[:, 0], top_p=f[:, 1], min_p=f[:, 2], top_k=i[:, 0], seeds=i[:, 1],
            positions=seq_lens_d[spans_s],
        )  # fmt: skip
    if patches:
        dst, src = take(), take()
        input_ids[dst] = patches[2][src]
    index = take() if sample_index is not None else None
    return StepInputs(input_ids, positions, meta, out_sampling, rows_d, index)


def _bits(floats: array.array) -> array.array:
    """float64 values as the int64 slots that carry their bits."""
    out = array.array("q")
    out.frombytes(floats.tobytes())
    return out
