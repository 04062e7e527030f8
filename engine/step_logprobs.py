"""A step's logprobs, read to the host once per step.

On a GPU every read of a device tensor (``int(t[row])``, ``t[row].tolist()``) is a copy that waits
for the stream: read per row, a step with 256 rows of logprobs synced the device about a thousand
times, and an overlapped step's reads after the next step's launch waited for that step's forward
too. The runner reads each logprob tensor once (``logprob_lists``); an overlapped step copies them
to pinned memory without blocking at launch (``host_copies``), next to its sampled ids.
"""

from __future__ import annotations

import torch

from engine.sampler import SamplerOutput


def host_copies(result: SamplerOutput) -> SamplerOutput:
    """``result``'s logprob tensors copied to pinned host memory without blocking (valid once the
    step's ``ready`` event has passed); ``token_ids`` is not copied (``host_tokens`` is)."""

    def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    return SamplerOutput(
        None, pinned(result.sampled_logprobs), pinned(result.top_ids), pinned(result.top_logprobs)
    )


def logprob_lists(
    result: SamplerOutput,
) -> tuple[list[float], list[list[int]] | None, list[list[float]] | None]:
    """A step's logprobs as host lists, each tensor read once: on a GPU each read of a device
    tensor is a copy that waits for the stream, so one per row cost a sync per row."""
    top = result.top_ids is not None
    return (
        result.sampled_logprobs.tolist(),
        result.top_ids.tolist() if top else None,
        result.top_logprobs.tolist() if top else None,
    )


def logprob_dict(token: int, lists, row: int, k: int) -> dict[int, float]:
    """Row ``row``'s sampled ``token`` and its ``k`` most likely tokens with their logprobs."""
    sampled, top_ids, top_lps = lists
    d = {token: sampled[row]}
    if k:
        for tid, lp in zip(top_ids[row][:k], top_lps[row][:k]):
            d.setdefault(tid, lp)
    return d
