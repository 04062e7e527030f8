"""What a Decode stream sends, and when: outputs joined per sample, and held back to ``stream_interval``.

``merge_outputs`` joins the outputs a stream found queued (a reader that fell behind catches up in
one message, not one per token). ``StreamInterval`` holds a sample's tokens until ``interval`` of
them wait, as ``--stream-interval`` does in vLLM and SGLang: every message costs the worker's gRPC
thread, the router and the HTTP server the same whatever it carries, so on a machine where they
share cores with the engine, fewer messages leave the engine more of them (bench/README.md). A
sample's first token, its last (with its finish reason) and errors are never held, so TTFT and the
end of a stream do not move; a stream that goes quiet for ``keepalive_s`` sends what it holds.
"""

from __future__ import annotations

import dataclasses

from engine.scheduler_output import SequenceOutput


def merge_outputs(outs: list[SequenceOutput]) -> list[SequenceOutput]:
    """Each sample's queued outputs joined into one (tokens and logprobs in order, the last one's
    finish), samples in the order they first appear (the engine interleaves them step by step); an
    error output stands alone. One output comes back as it is."""
    if len(outs) == 1:
        return outs
    merged: list[SequenceOutput] = []
    open_: dict[int, SequenceOutput] = {}  # sample -> its output still taking tokens
    for out in outs:
        last = open_.get(out.sample_index)
        if last is None or last.finish_reason is not None or last.error or out.error:
            last = open_[out.sample_index] = dataclasses.replace(out, new_token_ids=list(out.new_token_ids))
            merged.append(last)
            continue
        last.new_token_ids.extend(out.new_token_ids)
        if last.new_logprobs is not None or out.new_logprobs is not None:
            last.new_logprobs = [*(last.new_logprobs or []), *(out.new_logprobs or [])]
        last.finish_reason, last.stop_reason = out.finish_reason, out.stop_reason
        last.num_cached_tokens = out.num_cached_tokens or last.num_cached_tokens
    return merged


class StreamInterval:
    """One stream's held tokens. ``release`` takes merged outputs and returns those to send now;
    ``flush`` returns everything held (the stream went quiet). ``first_sent``: the request's first
    token already went out elsewhere (the prefill worker's, after a KV hand-off)."""

    def __init__(self, interval: int, *, first_sent: bool = False) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {interval}")
        self.interval = interval
        self._first_sent = first_sent
        self._started: set[int] = set()  # samples whose first token went out
        self._held: dict[int, SequenceOutput] = {}

    def release(self, outs: list[SequenceOutput]) -> list[SequenceOutput]:
        if self.interval == 1 and not self._held:
            return outs
        ready = []
        for out in outs:
            held = self._held.pop(out.sample_index, None)
            if held is not None and not out.error:
                out = merge_outputs([held, out])[0]
            elif held is not None:  # an error stands alone: what was held goes first
                ready.append(held)
            started = self._first_sent or out.sample_index in self._started
            if (
                out.finish_reason is not None
                or out.error
                or not started
                or len(out.new_token_ids) >= self.interval
            ):
                if out.new_token_ids:
                    self._started.add(out.sample_index)
                ready.append(out)
            else:
                self._held[out.sample_index] = out
        return ready

    def flush(self) -> list[SequenceOutput]:
        outs = list(self._held.values())
        self._held.clear()
        return outs
