"""The planner validation's replay: requests sent at their arrival times to a real streaming server
(``bench.minimal_server`` on the tiny model), each one's chunk times on the replay's clock, in the
form the simulator's summary takes."""

from __future__ import annotations

import asyncio
import itertools

from bench.minimal_server import minimal_serving
from bench.planner_validation import errors, replay
from planner.simulator import SimRequest, summarize


def test_a_replay_times_every_request_from_its_arrival(tiny_llama):
    requests = [
        SimRequest(0.0, [5, 6, 7, 8], 6),
        SimRequest(0.3, [9, 10, 11], 4),
        SimRequest(0.6, [12] * 20, 5),
    ]
    with minimal_serving(str(tiny_llama)) as base:
        measured = asyncio.run(replay(base, requests))
    for want, got in zip(requests, measured, strict=True):
        assert got.arrival == want.arrival and got.prompt == want.prompt
        assert got.first_token > want.arrival  # sent no earlier than its arrival
        assert 1 <= len(got.token_times) <= want.output_len and got.token_times[0] == got.first_token
        assert all(a <= b for a, b in itertools.pairwise(got.token_times))
    summary = summarize(measured).as_dict()
    assert summary["requests"] == 3 and summary["ttft_p50"] > 0 and summary["throughput"] > 0
    assert errors(summary, {**summary, "ttft_p50": 2 * summary["ttft_p50"]})["ttft_p50"] == 1.0
