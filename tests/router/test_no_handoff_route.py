"""A decode worker that takes no KV hand-offs (its engine in a process of its own) registers with
``kv_handoff=0``; the router then runs every request it picks for that worker aggregated (no prefill
call, no KV handle), while a worker that takes them still gets disaggregated routes. Real Redis,
the records as workers write them."""

from __future__ import annotations

import time

import pytest

from registry.cluster_view import ClusterView
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect
from router.router import Router


@pytest.mark.parametrize("kv_handoff", [0, 1])
def test_a_worker_taking_no_handoffs_gets_aggregated_routes(redis_server, kv_handoff):
    url = redis_server.url
    for wid, role, extra in (("p0", "prefill", {}), ("d0", "decode", {"kv_handoff": kv_handoff})):
        record = WorkerRecord(
            worker_id=wid, role=role, address=f"127.0.0.1:{9}", epoch=1, block_size=4, **extra
        )
        WorkerRegistration(connect(url), record).register([])
    view = ClusterView(url, poll_s=0.05)
    view.start()
    try:
        deadline = time.monotonic() + 10
        while len(view.live_workers()) < 2:
            assert time.monotonic() < deadline, "the view never listed both workers"
            time.sleep(0.01)
        assert view.live_workers("decode")[0].kv_handoff == kv_handoff  # it survives the round trip
        route = Router(view, local_prefill_tokens=0).route(list(range(3, 40)))
        assert route.decode.worker_id == "d0"
        assert (route.prefill is None) == (kv_handoff == 0)
    finally:
        view.stop()
