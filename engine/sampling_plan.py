"""How a step samples, decided on the host before its forward (so that what the device needs
travels in the step's one upload, ``engine.persistent_batch``).

Three cases: every sampled row greedy (nothing travels: an argmax reads no parameter); one sample per
sequence from its stored parameters (only the rows travel, and the device gathers their parameters);
or forks, logprobs or logits processing (each sampled row's parameters travel in full, and the
penalties' token histories are gathered on the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.logits_processing import RowHistory
from engine.persistent_batch import SampleGather, SamplingScalars
from engine.sampler import sample_seed


@dataclass(slots=True)
class SamplingPlan:
    # Sampled row -> its sequence's logits row, and each row's logprobs; None: one row per sequence,
    # all greedy without logprobs (the plan of a plain decode step, built in O(1)).
    expand: list[int] | None = None
    want_logprobs: list[int | None] | None = None
    processed: list[tuple[int, RowHistory]] = field(default_factory=list)
    holders: list[tuple[object, RowHistory]] = field(default_factory=list)
    scalars: SamplingScalars | SampleGather | None = None  # None: every row greedy
    flags: tuple[bool, bool, bool] | None = None  # any top-k, top-p, min-p; None: every row greedy
    tensors: dict[str, torch.Tensor] | None = None  # the scalars on the device


def plan_sampling(
    seqs: dict,
    special: set[str],
    random: set[str],
    row_of: dict[str, int],
    eos_token_ids: frozenset[int],
    sample_rows: list[tuple[int, str, int]],
    sample_spans: list[int],
    forks: bool,
) -> SamplingPlan:
    """How this step samples: every row greedy (nothing travels); one sample per sequence from
    its stored parameters (their rows travel; the device gathers them); or, with forks, logprobs
    or logits processing, each sampled row's parameters in full."""
    plan = SamplingPlan()
    if not forks and (not special or special.isdisjoint(s for _, s, _ in sample_rows)):
        if not random or random.isdisjoint(s for _, s, _ in sample_rows):
            return plan  # every row greedy, one sample each, no logprobs, no logits processing
        top_k = top_p = min_p = False
        for _, seq_id, _ in sample_rows:
            p = seqs[seq_id].params
            top_k, top_p, min_p = top_k or p.top_k > 0, top_p or p.top_p < 1, min_p or p.min_p > 0
        plan.scalars = SampleGather([row_of[s] for _, s, _ in sample_rows], sample_spans)
        plan.flags = (top_k, top_p, min_p)
        return plan
    plan.expand, plan.want_logprobs = [], []
    temps, top_ks, top_ps, min_ps, seeds, positions = [], [], [], [], [], []
    for i, (_, seq_id, n) in enumerate(sample_rows):
        state = seqs[seq_id]
        p = state.params
        for s in range(n):
            if p.processes_logits:
                history = RowHistory(
                    p,
                    state.token_ids,
                    state.output_start,
                    state.prompt_len,
                    eos_token_ids,
                    state.prompt_tokens,
                )
                plan.processed.append((len(plan.expand), history))
                plan.holders.append((state, history))
            plan.expand.append(i)
            temps.append(p.temperature)
            top_ks.append(p.top_k)
            top_ps.append(p.top_p)
            min_ps.append(p.min_p)
            seeds.append(sample_seed(state.seed, state.sample_index + s))
            positions.append(len(state.token_ids))
            plan.want_logprobs.append(p.logprobs)
    if not all(t == 0 or k == 1 for t, k in zip(temps, top_ks)):
        plan.scalars = SamplingScalars(temps, top_ks, top_ps, min_ps, seeds, positions)
        plan.flags = (any(k > 0 for k in top_ks), any(p < 1 for p in top_ps), any(m > 0 for m in min_ps))
    return plan
