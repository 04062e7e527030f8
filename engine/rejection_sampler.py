"""Verifying drafted tokens so that the output keeps the target model's distribution.

Drafts here are proposed greedily (the draft's argmax, or an n-gram continuation): the draft
distribution q is one-hot on the proposed token d. Speculative sampling (Leviathan et al., Chen et
al.) then reads: accept d with probability min(1, p(d) / q(d)) = p(d); on rejection, emit a token
from the residual max(0, p - q), i.e. p without d, renormalized. The emitted token is d with
probability p(d) and x != d with probability (1 - p(d)) p(x) / (1 - p(d)) = p(x): exactly p. After
the last draft, the bonus token is drawn from p itself. Greedy rows accept d iff it is p's argmax, so
greedy output equals non-speculative greedy output token for token.

Randomness stays a function of (seed, position): the acceptance draw of the token at position t is
``uniform_scalar(seed, t)``, the residual or bonus draw uses the same noise as ordinary sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import SamplingBatch, exponential_race, filtered_probs, row_argmax, uniform_scalar


@dataclass(slots=True)
class Verified:
    emitted: torch.Tensor  # [R] the token each row emits if it is reached (its draft when accepted)
    accepted: torch.Tensor  # [R] bool: the row's draft was accepted (False on bonus rows)


def rejection_sample(logits: torch.Tensor, batch: SamplingBatch, draft_ids: torch.Tensor) -> Verified:
    """``logits`` [R, V] of the rows that verify (each sequence's rows in order: one per draft, then
    its bonus row); ``draft_ids`` [R] the draft each row checks, -1 on bonus rows."""
    logits = logits.float()
    greedy = row_argmax(logits)
    has_draft = draft_ids >= 0
    d = draft_ids.clamp(min=0)
    if batch.all_greedy:
        accepted = has_draft & (greedy == d)
        return Verified(torch.where(accepted, d, greedy), accepted)
    probs = filtered_probs(logits, batch)
    p_d = probs.gather(1, d[:, None]).squeeze(1) / probs.sum(dim=-1)  # min-p leaves rows unnormalized
    random_accept = uniform_scalar(batch.seeds, batch.positions) < p_d.double()
    residual = torch.where(has_draft[:, None], probs.scatter(1, d[:, None], 0.0), probs)
    # p one-hot on d yet rejected (rounding of p(d) ~ 1): fall back to p itself.
    residual = torch.where((residual.sum(dim=-1) > 0)[:, None], residual, probs)
    sampled = exponential_race(residual, batch.seeds, batch.positions)
    is_greedy = batch.temperature == 0
    accepted = has_draft & torch.where(is_greedy, greedy == d, random_accept)
    return Verified(torch.where(accepted, d, torch.where(is_greedy, greedy, sampled)), accepted)


def accepted_prefix(emitted: list[int], accepted: list[bool], first: int, num_drafts: int) -> list[int]:
    """The tokens a sequence emits: its accepted drafts, then the token of its first rejected row
    (a recovered token) or, when every draft was accepted, of its bonus row."""
    out = []
    for r in range(first, first + num_drafts + 1):
        out.append(emitted[r])
        if r == first + num_drafts or not accepted[r]:
            return out
    return out
