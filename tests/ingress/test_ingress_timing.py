"""Per-request hop timing at the HTTP surface: with ``x-pdserve-debug: timing`` a non-streaming
answer carries ``x-pdserve-timing`` (Server-Timing syntax) and the same hops in its body, a
streaming one carries them in its last chunk before ``[DONE]``; the ingress's own hops come with
the router's and the workers'; without the header nothing is added; every request feeds the
``pdserve_hop_seconds`` histogram. The router is a scripted stream; the app is driven over ASGI."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgi_client import call
from prometheus_client.parser import text_string_to_metric_families
from test_ingress_logic import ScriptedRouter

from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_serving import OpenAIServing
from ingress.options import IngressOptions
from ingress.request_timing import format_timing, parse_timing, wants_timing
from proto import pdserve_pb2 as pb

WORKERS = {"route_ms": 0.1, "router_ms": 0.5, "prefill_queue_ms": 1.0, "kv_transfer_ms": 2.0}
INGRESS_HOPS = {"ingress_parse", "ingress_queue", "ingress", "router_call", "ttft", "e2e"}


def _messages() -> list[pb.GenerateResponse]:
    return [
        pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[5])),
        pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[6, 7])),
        pb.GenerateResponse(
            finished=pb.Finished(finish_reason="length", usage=pb.Usage(), timing=pb.HopTiming(**WORKERS))
        ),
    ]


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


def _app(info):
    metrics = IngressMetrics("tiny")
    serving = OpenAIServing(info, IngressOptions(), ScriptedRouter(_messages()), metrics)

    async def health():
        return True, {}

    async def render():
        return metrics.render(None, [], ("0", 0, 0))

    return build_http_app(serving, None, health, render)


BODY = {"model": "tiny", "prompt": "a", "max_tokens": 3, "temperature": 0}
DEBUG = {"x-pdserve-debug": "timing"}


def _check_hops(hops: dict[str, float]) -> None:
    assert INGRESS_HOPS | {k.removesuffix("_ms") for k in WORKERS} <= set(hops)
    assert all(v >= 0 for v in hops.values())
    assert {k: hops[k.removesuffix("_ms")] for k in WORKERS} == pytest.approx(WORKERS, abs=1e-6)


def test_non_streaming_answer_carries_the_timing_header_and_field(info):
    async def run():
        app = _app(info)
        r = await call(app, "/v1/completions", BODY, DEBUG)
        assert r.status == 200
        body = json.loads(r.body)
        header = parse_timing(r.headers["x-pdserve-timing"])
        _check_hops(header)
        assert header == pytest.approx(body["pdserve_timing"], abs=1e-3)
        plain = await call(_app(info), "/v1/completions", BODY)
        assert "x-pdserve-timing" not in plain.headers and "pdserve_timing" not in json.loads(plain.body)

    asyncio.run(run())


def _events(raw: bytes) -> list:
    lines = [ln[len(b"data: ") :] for ln in raw.split(b"\n\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_streaming_answer_carries_the_timing_in_its_last_chunk(info):
    async def run():
        app = _app(info)
        r = await call(app, "/v1/completions", {**BODY, "stream": True}, DEBUG)
        events = _events(r.body)
        assert "".join(c["text"] for e in events for c in e["choices"])  # the tokens came through
        last = events[-1]
        assert last["choices"] == [] and "usage" not in last
        _check_hops(last["pdserve_timing"])
        assert all("pdserve_timing" not in e for e in events[:-1])
        r = await call(
            app, "/v1/completions", {**BODY, "stream": True, "stream_options": {"include_usage": True}}, DEBUG
        )
        last = _events(r.body)[-1]
        assert last["usage"]["completion_tokens"] == 3 and "pdserve_timing" in last
        r = await call(app, "/v1/completions", {**BODY, "stream": True})
        assert all("pdserve_timing" not in e for e in _events(r.body))
        # Every request, asked or not, fed the per-hop histogram.
        text = (await call(app, "/metrics")).body.decode()
        counts = {
            s.labels["hop"]: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "pdserve_hop_seconds_count"
        }
        assert counts["route"] == counts["ingress_parse"] == counts["kv_transfer"] == 3
        assert "ttft" not in counts  # a total, not a hop: TTFT has its own histogram

    asyncio.run(run())


def test_timing_header_round_trips_and_the_debug_header_is_parsed():
    hops = {"ingress_parse": 0.25, "route": 0.031, "kv_transfer": 12.5}
    assert parse_timing(format_timing(hops)) == hops
    assert wants_timing("timing") and wants_timing("Timing, other") and not wants_timing("tim")
    assert not wants_timing(None)
