"""A step's flat batch, built on the host from the scheduler's output and the runner's state.

Decodes come first, one token each; the scheduler's fast-path decodes (``SchedulerOutput.decode_ids``)
lead, built with a list operation per column rather than a loop iteration per sequence. A
speculating sequence's span is its last token and its drafts. A token still being sampled by the
step in flight (overlapped scheduling: a PLACEHOLDER) is read on the device: a patch.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from itertools import repeat

import torch

from engine.device_copy import ints_on
from engine.persistent_batch import FlatBatch
from engine.request import PLACEHOLDER
from engine.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class RepeatCache:
    """A steady decode batch's columns, kept from the step that built them: the fast-path decodes'
    ids, their table rows, sample rows, token lists and sample-row index. A step whose fast-path
    decodes are the last one's (list equality of the same strings: 2 us for 256) reuses them, and,
    when the last step sampled exactly those sequences on the host, its sampled tokens as this
    step's inputs. The runner clears it when its sequences change (one arrives, resumes or ends)."""

    ids: list[str] = field(default_factory=list)
    rows: array.array = field(default_factory=lambda: array.array("q"))
    sample_rows: list[tuple[int, str, int]] = field(default_factory=list)
    lists: list[list[int]] = field(default_factory=list)  # the runner's token list of each of ``ids``
    index: dict[str, int] = field(default_factory=dict)  # each of ``ids``'s sample row
    sampled: list[int] | None = None  # what the last step sampled for ``ids``, in order (set by collect)


@dataclass(slots=True)
class StepBatch:
    flat: FlatBatch
    sample_rows: list[tuple[int, str, int]]  # (row, seq, samples)
    sample_spans: list[int]  # each sampled row's span
    spec_rows: list[tuple[int, str, list[int]]]
    forks: dict[str, int]  # seq_id -> samples, where more than one
    patch_dst: list[int]  # input rows read from the step in flight
    patch_src: list[int]  # ... at these rows of its samples
    repeat: bool = False  # it samples the repeat cache's ids alone, in order


def batch_order(
    sched: SchedulerOutput, drafts: dict[str, list[int]], seqs: dict, by_length: bool
) -> tuple[list[str], list[int]]:
    """(order, positions): decodes first, the scheduler's fast-path decodes leading (``positions``
    are theirs, in order); ``by_length`` (the torch backend, which groups decodes by length) sorts
    each kind of decode longest context first. A sequence that speculates this step runs as a short
    prefill chunk."""
    n = sched.num_scheduled_tokens
    if drafts:
        return sorted(n, key=lambda s: (n[s] != 1 or bool(drafts.get(s)), -len(seqs[s].token_ids))), []
    fast, at = sched.decode_ids, sched.decode_positions
    if by_length and len(fast) > 1:
        by_pos = sorted(range(len(fast)), key=at.__getitem__, reverse=True)
        fast, at = [fast[i] for i in by_pos], [at[i] for i in by_pos]
    if len(fast) == len(n):
        return fast, at
    known = set(fast)
    rest = [s for s in n if s not in known]
    decodes = [s for s in rest if n[s] == 1]
    if by_length:
        decodes.sort(key=lambda s: -len(seqs[s].token_ids))
    return fast + decodes + [s for s in rest if n[s] != 1], at


def flatten_step(
    sched: SchedulerOutput,
    order: list[str],
    at: list[int],
    drafts: dict[str, list[int]],
    seqs: dict,
    row_of: dict[str, int],
    inflight_rows: dict[str, int] | None,
    cache: RepeatCache,
) -> StepBatch:
    """The step's spans in ``order`` (its first ``len(at)`` the fast-path decodes, at positions
    ``at``; ``at`` is empty when drafts reorder the batch); ``inflight_rows``: the step in flight's
    sample row of each sequence it samples (overlapped scheduling)."""
    out = StepBatch(FlatBatch(), [], [], [], {}, [], [])
    sampled, cache.sampled = cache.sampled, None  # valid for the step right after it only
    forks = out.forks
    computed: dict[str, int] = {}  # where the spans after the fast-path decodes start
    for d in (*sched.new_seqs, *sched.running_seqs):
        computed[d.seq_id] = d.num_computed_tokens
        if d.num_samples > 1:
            forks[d.seq_id] = d.num_samples
    if not at:  # the fast-path decodes are among the spans below
        computed.update(zip(sched.decode_ids, sched.decode_positions))
    num_scheduled = sched.num_scheduled_tokens
    flat, sample_rows, sample_spans = out.flat, out.sample_rows, out.sample_spans
    patch_dst, patch_src = out.patch_dst, out.patch_src
    tokens, positions, token_rows, seq_lens = flat.tokens, flat.positions, flat.token_rows, flat.seq_lens
    row = bulk = len(at)
    if bulk:  # the fast-path decodes, a list operation each: one token, its last, sampled once
        ids = order[:bulk]
        if ids != cache.ids:  # NOTE: a steady decode batch repeats its ids: these columns are kept
            cache.ids, cache.lists = ids, [seqs[s].token_ids for s in ids]
            cache.rows = array.array("q", [row_of[s] for s in ids])
            cache.sample_rows = list(zip(range(bulk), ids, repeat(1)))
            cache.index = dict(zip(ids, range(bulk)))
            sampled = None
        toks = sampled if sampled is not None else [t[p] for t, p in zip(cache.lists, at)]
        tokens.extend(toks)
        positions.extend(at)
        token_rows.extend(cache.rows)
        seq_lens.extend([p + 1 for p in at])
        sample_rows.extend(cache.sample_rows)
        sample_spans.extend(range(bulk))
        if PLACEHOLDER in toks:  # sampled by the step in flight: read on the device
            if toks.count(PLACEHOLDER) == bulk:
                patch_dst.extend(range(bulk))
                if inflight_rows is cache.index:  # the step in flight sampled these, in this order
                    patch_src.extend(range(bulk))
                else:
                    patch_src.extend([inflight_rows[s] for s in ids])
            else:
                for i, tok in enumerate(toks):
                    if tok == PLACEHOLDER:
                        patch_dst.append(i)
                        patch_src.append(inflight_rows[ids[i]])
    # Other decodes (one token each, its last: it samples), in one lean loop.
    for seq_id in order[bulk:]:
        if num_scheduled[seq_id] != 1 or (drafts and seq_id in drafts):
            break
        token_ids = seqs[seq_id].token_ids
        start = computed[seq_id]
        if start + 1 != len(token_ids):
            break  # a one-token prefill chunk: the general loop below
        tok = token_ids[start]
        r = row_of[seq_id]
        tokens.append(tok)
        positions.append(start)
        token_rows.append(r)
        seq_lens.append(start + 1)
        sample_rows.append((row, seq_id, forks.get(seq_id, 1) if forks else 1))
        sample_spans.append(row)
        if tok == PLACEHOLDER:  # sampled by the step in flight: read it on the device
            patch_dst.append(row)
            patch_src.append(inflight_rows[seq_id])
        row += 1
    if row:
        flat.span_rows.extend(token_rows)
        flat.query_start_loc.extend(range(1, row + 1))
        flat.num_decodes = row
    for seq_id in order[row:]:
        token_ids = seqs[seq_id].token_ids
        start = computed[seq_id]
        k = num_scheduled[seq_id]
        draft = drafts.get(seq_id) if drafts else None
        if draft:
            toks = [token_ids[start], *draft]
            out.spec_rows.append((row, seq_id, draft))
        else:
            toks = token_ids[start : start + k]
            n = len(toks)  # k, unless slots were scheduled for drafts that were not proposed
            if start + n == len(token_ids):
                sample_rows.append((row + n - 1, seq_id, forks.get(seq_id, 1) if forks else 1))
                sample_spans.append(len(flat.seq_lens))
            if n and toks[-1] == PLACEHOLDER:  # sampled by the step in flight: read it on the device
                assert n == 1 and inflight_rows is not None, "only a decode reads a placeholder"
                patch_dst.append(row)
                patch_src.append(inflight_rows[seq_id])
        flat.add(toks, start, row_of[seq_id])
        row += len(toks)
    out.repeat = bulk > 0 and len(sample_rows) == bulk and not out.spec_rows
    return out


def sampled_hidden(
    hidden: torch.Tensor, sample_rows: list[tuple[int, str, int]], index: torch.Tensor | None = None
) -> torch.Tensor:
    """The rows of ``hidden`` that sample: a view when they lead it (every step of decodes alone),
    else one gather (indexing with a list of 256 rows costs the host 40 us; a view, 1), by ``index``
    where the step's upload carried the rows (``sample_rows_index``), else from the host without a
    sync (``engine.device_copy``)."""
    n = len(sample_rows)
    if sample_rows[-1][0] == n - 1:  # rows strictly increase from 0, so these are rows 0 .. n-1
        return hidden[:n]
    if index is None:
        index = ints_on(sample_rows_index(sample_rows), hidden.device)
    return hidden.index_select(0, index)


def sample_rows_index(sample_rows: list[tuple[int, str, int]]) -> array.array | None:
    """The flat rows that sample, or None when they are rows 0 .. n-1 (``sampled_hidden`` takes a
    view then)."""
    if not sample_rows or sample_rows[-1][0] == len(sample_rows) - 1:
        return None
    return array.array("q", [r for r, _, _ in sample_rows])
