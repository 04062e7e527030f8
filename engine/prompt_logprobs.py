"""``prompt_logprobs``: the logprob of each prompt token given the ones before it, from the hidden
states a prefill step computes anyway (position p's logits score the token at p + 1).

Computed per chunk, for the sequences that asked, over their scheduled prompt positions except the
last (whose logits give the first output token, sampled as usual); the scheduler files each chunk's
values at their positions, so a recompute after preemption only writes the same values again.
"""

from __future__ import annotations

import torch


def prompt_logprobs(
    model, hidden: torch.Tensor, seqs: dict, sched, order: list[str], query_start_loc: list[int]
) -> dict:
    """seq_id -> (first position, [{prompt token: logprob, top-k alternatives...}, ...]); sequence
    ``order[i]``'s rows of ``hidden`` start at ``query_start_loc[i]``."""
    computed = sched.computed_before()
    rows: list[int] = []
    spans: list[tuple[str, int, int, int]] = []  # (seq, first position, first row in ``rows``, count)
    for i, seq_id in enumerate(order):
        row, n = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
        state = seqs[seq_id]
        start = computed[seq_id]
        end = min(start + n, state.prompt_len - 1)
        if state.params.prompt_logprobs is not None and end > start:
            spans.append((seq_id, start, len(rows), end - start))
            rows.extend(range(row, row + end - start))
    if not spans:
        return {}
    logprobs = torch.log_softmax(model.compute_logits(hidden[rows]).float(), dim=-1)
    targets = torch.tensor(
        [seqs[s].token_ids[p + 1] for s, start, _, count in spans for p in range(start, start + count)],
        dtype=torch.int64,
        device=logprobs.device,
    )
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    k = max(seqs[s].params.prompt_logprobs for s, *_ in spans)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    top_lp = top_lp.tolist() if k else None
    top_ids = top_ids.tolist() if k else None
    tlist = targets.tolist()
    out = {}
    for seq_id, start, first, count in spans:
        want = seqs[seq_id].params.prompt_logprobs
        entries = []
        for i in range(first, first + count):
            entry = {tlist[i]: chosen[i]}
            if want:
                for tid, lp in zip(top_ids[i][:want], top_lp[i][:want]):
                    entry.setdefault(tid, lp)
            entries.append(entry)
        out[seq_id] = (start, entries)
    return out
