"""Where a request's time went, hop by hop, as the ingress reports it.

Every request is stamped (``time.perf_counter()``): the HTTP handler took it -> validated (body read,
parsed, checked, tokenized) -> admitted (a slot among ``max_concurrent_requests``) -> the router
called -> the first token in from the router -> the first token handed to the HTTP server -> the
last message. The router's ``Finished`` brings the router's and the workers' own durations
(``HopTiming``). Together they give the hops below, in milliseconds, observed into the
``pdserve_hop_seconds`` histogram for every request and, when the client sends
``x-pdserve-debug: timing``, returned with the response (``pdserve_timing`` in the body or last
stream chunk, and the ``x-pdserve-timing`` header, Server-Timing syntax, when not streaming).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import pdserve_pb2 as pb

DEBUG_HEADER = "x-pdserve-debug"  # the client asks: "timing"
TIMING_HEADER = "x-pdserve-timing"  # the answer: "hop;dur=1.234, ..."
TIMING_FIELD = "pdserve_timing"  # the answer in the JSON body / the last stream chunk

# Not hops: the ingress's whole view, for comparison with the client's (the difference is the
# HTTP proxy and the network).
TOTALS = ("ttft", "e2e")


def wants_timing(header_value: str | None) -> bool:
    return header_value is not None and "timing" in {v.strip().lower() for v in header_value.split(",")}


@dataclass(slots=True)
class IngressStamps:
    arrived: float
    validated: float = 0.0
    admitted: float = 0.0
    router_called: float = 0.0
    first_token: float | None = None  # first token in from the router
    first_out: float | None = None  # first token handed to the HTTP server
    finished: float | None = None
    workers: pb.HopTiming | None = None  # the router's and the workers' part (from Finished)

    def hops(self) -> dict[str, float]:
        """Hop -> milliseconds, along the request's path; hops it did not pass are left out."""
        ms: dict[str, float] = {}
        ms["ingress_parse"] = _ms(self.validated - self.arrived)
        ms["ingress_queue"] = _ms(self.admitted - self.validated)
        if self.first_token is not None:
            router_call = self.first_token - self.router_called
            out = self.first_out if self.first_out is not None else self.first_token
            ms["ingress"] = _ms(out - self.admitted - router_call)  # its own time to the first token
            ms["router_call"] = _ms(router_call)
        if self.workers is not None:
            for fd, value in self.workers.ListFields():
                ms[fd.name.removesuffix("_ms")] = max(0.0, value)
        if self.first_out is not None:
            ms["ttft"] = _ms(self.first_out - self.arrived)
        if self.finished is not None:
            ms["e2e"] = _ms(self.finished - self.arrived)
        return ms


def format_timing(hops: dict[str, float]) -> str:
    """Server-Timing syntax: ``ingress_parse;dur=0.412, route;dur=0.051, ...``."""
    return ", ".join(f"{name};dur={value:.3f}" for name, value in hops.items())


def parse_timing(header: str) -> dict[str, float]:
    out = {}
    for item in header.split(","):
        name, _, dur = item.strip().partition(";dur=")
        if name and dur:
            out[name] = float(dur)
    return out


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1e3, 3)
