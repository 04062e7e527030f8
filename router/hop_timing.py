"""The router's part of a request's hop timing, and a window of recent requests' timings.

A request's stamps here (``time.perf_counter()``): Generate taken (``RouterClock()``) -> routed ->
the prefill call returned, with the prefill worker's own timing (disaggregated) -> the decode call
opened -> its first message -> the first token sent on -> the first ``Finished``, into which the
router writes the prefill worker's part and its own (the decode worker wrote its part), and which it
records in the ``HopWindow`` that ``pdserve status`` summarises.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from proto import pdserve_pb2 as pb

HOPS = tuple(f.name for f in pb.HopTiming.DESCRIPTOR.fields)  # in the message's order


class HopWindow:
    """The hop timings of the last ``size`` finished requests."""

    def __init__(self, size: int = 1024) -> None:
        self._recent: deque[list[tuple[str, float]]] = deque(maxlen=size)

    def add(self, timing: pb.HopTiming) -> None:
        self._recent.append([(fd.name, value) for fd, value in timing.ListFields()])

    def __len__(self) -> int:
        return len(self._recent)

    def summary(self) -> list[pb.HopSummary]:
        by_hop: dict[str, list[float]] = {}
        for fields in self._recent:
            for name, value in fields:
                by_hop.setdefault(name, []).append(value)
        out = []
        for name in HOPS:
            values = sorted(by_hop.get(name, ()))
            if values:
                out.append(
                    pb.HopSummary(
                        hop=name.removesuffix("_ms"),
                        count=len(values),
                        mean_ms=statistics.fmean(values),
                        p50_ms=_pct(values, 50),
                        p90_ms=_pct(values, 90),
                    )
                )
        return out


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))]


class RouterClock:
    """One request's stamps in the router; cheap per message (one oneof check)."""

    __slots__ = (
        "decode_opened",
        "decode_s",
        "first_token_s",
        "prefill_s",
        "prefill_timing",
        "recorded",
        "route_s",
        "started",
        "window",
    )

    def __init__(self, window: HopWindow) -> None:
        self.window = window
        self.started = time.perf_counter()
        self.route_s: float | None = None
        self.prefill_s: float | None = None  # the prefill call, retries included
        self.prefill_timing: pb.HopTiming | None = None
        self.decode_opened: float | None = None
        self.decode_s: float | None = None  # decode call opened -> its first message
        self.first_token_s: float | None = None  # Generate taken -> first token sent on
        self.recorded = False

    def routed(self) -> None:
        if self.route_s is None:
            self.route_s = time.perf_counter() - self.started

    def prefilled(self, resp: pb.PrefillResponse) -> None:
        self.prefill_s = time.perf_counter() - self.started - (self.route_s or 0.0)
        self.prefill_timing = resp.timing

    def first_token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started

    def decoding(self) -> None:
        """The decode call is about to open (a swap to another decode worker keeps this stamp, so
        ``decode_call`` then includes the failed attempt)."""
        self.decode_opened, self.decode_s = time.perf_counter(), None

    def on_message(self, msg: pb.GenerateResponse) -> None:
        """Every message relayed to the caller, before it is sent on."""
        if self.decode_s is None and self.decode_opened is not None:
            self.decode_s = time.perf_counter() - self.decode_opened
        kind = msg.WhichOneof("kind")
        if kind == "tokens":
            if self.first_token_s is None:
                self.first_token()
        elif kind == "finished":
            self.stamp(msg.finished.timing)

    def stamp(self, t: pb.HopTiming) -> None:
        """Write the router's (and the prefill worker's) part into ``t``; recorded once."""
        if self.prefill_timing is not None:
            t.MergeFrom(self.prefill_timing)
        if self.route_s is not None:
            t.route_ms = self.route_s * 1e3
        if self.prefill_s is not None:
            t.prefill_call_ms = self.prefill_s * 1e3
        if self.decode_s is not None:
            t.decode_call_ms = self.decode_s * 1e3
        if self.first_token_s is not None:
            # The worker call the first token waited for: prefill when disaggregated, else decode.
            waited = self.prefill_s if self.prefill_s is not None else self.decode_s
            t.router_ms = max(0.0, self.first_token_s - (waited or 0.0)) * 1e3
        if not self.recorded:
            self.recorded = True
            self.window.add(t)
