"""A steady decode batch's inputs, kept on the device and advanced there: no host batch at all.

When a step decodes the same sequences as the step right before it, in the same order, and that
step sampled exactly them, each sequence is one token further: its position and context length
are the last step's plus one, and its input token is what the last step sampled, a tensor already
on the device. ``RepeatInputs`` keeps those tensors, the rows' block tables (gathered once, then
written in place where a sequence opens a block: the per-step gather of ``upload_step`` grew with
the context) and the sampling parameters the rows gathered, and ``advance`` derives the next step's
inputs from them with a handful of device ops; only new block ids cross from the host. Host time
per steady step is then O(1) in tensors and O(new blocks) in data, whatever the batch's context.

The runner keeps one while it stays valid: ``ModelRunner._prepare`` drops it at any step that does
not advance it (a sequence arrives, ends, drafts, forks, needs its tokens on the host, or the
fast-path decodes change), and ``capture`` builds one again from the next steady step's inputs.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.device_copy import ints_on
from engine.persistent_batch import BlockTables, StepInputs, StepUploader, sampling_columns
from engine.sampling_plan import SamplingPlan


@dataclass(slots=True)
class RepeatInputs:
    order: torch.Tensor  # [B] 0 .. B - 1
    batch_index: torch.Tensor  # [table rows] each row's index in the batch; B (a spare row) if none
    tables: torch.Tensor  # [B + 1, max blocks] the batch's block tables (row B takes other writes)
    positions: torch.Tensor  # [B] the last step's
    seq_lens: torch.Tensor  # [B] the last step's
    query_start_loc: list[int]  # 0 .. B
    query_start_loc_tensor: torch.Tensor
    max_len: int  # the last step's longest context
    position_sum: int  # of the last step's positions: the next step's must be B more
    flags: tuple[bool, bool, bool] | None  # the sampling plan's (None: every row greedy)
    params: tuple[torch.Tensor, torch.Tensor] | None  # the rows' float and int sampling parameters
    tokens: torch.Tensor | None = None  # what the last step sampled: the next step's input ids

    @classmethod
    def capture(
        cls, inputs: StepInputs, rows: array.array, at: list[int], tables: BlockTables, plan: SamplingPlan
    ) -> RepeatInputs:
        """From a steady step's inputs (decodes alone, each sampled once, no expansion): ``rows``
        are its table rows, ``at`` its positions; on the device they are the step's span rows, which
        its upload carried (a copy of its own would wait for the device: ``engine.device_copy``)."""
        device = tables.table.device
        n = len(rows)
        rows_d = inputs.span_rows[:n] if inputs.span_rows is not None else ints_on(rows, device)
        batch_index = torch.full((tables.table.shape[0],), n, dtype=torch.int64, device=device)
        batch_index[rows_d] = torch.arange(n, device=device)
        batch_tables = torch.zeros((n + 1, tables.width), dtype=torch.int64, device=device)
        batch_tables[:n] = tables.table.index_select(0, rows_d)
        meta = inputs.meta
        params = None
        if plan.flags is not None:
            params = sampling_columns(tables.params.index_select(0, rows_d))
        return cls(
            torch.arange(n, device=device), batch_index, batch_tables, inputs.positions, meta.seq_lens,
            meta.query_start_loc, meta.query_start_loc_tensor, meta.max_seq_len, sum(at),
            plan.flags, params,
        )  # fmt: skip

    def advance(
        self,
        at: list[int],
        tables: BlockTables,
        uploader: StepUploader,
        block_size: int,
        backend: AttentionBackend,
    ) -> tuple[StepInputs, SamplingPlan] | None:
        """The next step's inputs and sampling plan, or None (the runner builds them on the host)
        when ``at`` is not every position one further or a sampling parameter is pending."""
        n = len(self.query_start_loc) - 1
        if self.tokens is None or len(at) != n or tables.pending_params[0]:
            return None
        position_sum = sum(at)
        if position_sum != self.position_sum + n:
            return None
        writes = tables.take_pending()
        if writes:  # blocks opened this step: into the runner's table and the batch's alike
            packed = array.array("q", writes[0])
            packed.extend(writes[1])
            packed.extend(writes[2])
            w_rows, w_cols, w_ids = uploader.upload(packed).view(3, -1)
            tables.table[w_rows, w_cols] = w_ids
            self.tables[self.batch_index[w_rows], w_cols] = w_ids
        positions = self.positions + 1
        seq_lens = positions + 1
        self.positions, self.seq_lens, self.position_sum = positions, seq_lens, position_sum
        self.max_len += 1
        width = -(-self.max_len // block_size)
        meta = AttentionMetadata(
            num_decodes=n,
            slot_blocks=self.tables[self.order, positions.div(block_size, rounding_mode="floor")],
            slot_offsets=positions % block_size,
            seq_lens=seq_lens,
            seq_lens_list=[p + 1 for p in at],
            query_start_loc=self.query_start_loc,
            block_tables=self.tables[:n, :width],
            block_size=block_size,
            query_start_loc_tensor=self.query_start_loc_tensor,
            max_seq_len=self.max_len,
        )
        backend.prepare(meta)
        plan = SamplingPlan(flags=self.flags)
        sampling = None
        if self.params is not None:
            f, i = self.params
            sampling = dict(
                temperature=f[:, 0],
                top_p=f[:, 1],
                min_p=f[:, 2],
                top_k=i[:, 0],
                seeds=i[:, 1],
                positions=seq_lens,
            )
        plan.tensors = sampling
        tokens, self.tokens = self.tokens, None
        return StepInputs(tokens, positions, meta, sampling), plan
