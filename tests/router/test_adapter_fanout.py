"""The router's fan-out of a LoRA adapter change (``router.adapters.change_adapter``), its logic over
workers that accept or refuse as the test says (the real workers' side is tests/e2e/test_lora_serving.py):
a name already served is refused unless the load replaces it; a replacement is checked everywhere
first, so one worker's refusal changes nothing anywhere; a new adapter refused by one worker is
unloaded from those that took it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from proto import pdserve_pb2 as pb
from router import adapters
from router.adapters import AdapterChangeFailed, change_adapter


class Worker:
    """A worker's record and its ``Adapter`` RPC: serves ``loras`` (name -> path); refuses the
    requests ``refuse(req)`` says to, with INVALID_ARGUMENT."""

    def __init__(self, worker_id: str, loras: dict[str, str], refuse=lambda req: False) -> None:
        self.worker_id, self.role, self.address = worker_id, "decode", worker_id
        self.loras, self.refuse, self.calls = dict(loras), refuse, []

    def lora_salt(self, name: str) -> str | None:
        return self.loras.get(name)

    async def Adapter(self, req: pb.AdapterRequest, timeout: float) -> pb.AdapterResponse:
        self.calls.append((req.name, req.path, req.unload, req.replace, req.check))
        if self.refuse(req):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="rank 32 > 16",
            )
        if not req.check:
            if req.unload:
                self.loras.pop(req.name)
            else:
                self.loras[req.name] = req.path
        return pb.AdapterResponse(loras=self.loras)


def _router(workers: list[Worker]):
    view = SimpleNamespace(live_workers=lambda: list(workers), redis_url="redis://unused")
    stubs = SimpleNamespace(decode=lambda address: next(w for w in workers if w.address == address))
    return SimpleNamespace(view=view, stubs=stubs)


@pytest.fixture(autouse=True)
def _no_redis(monkeypatch):
    remembered = []
    monkeypatch.setattr(adapters, "_remember", lambda url, name, path: remembered.append((name, path)))
    return remembered


def _change(workers, **req) -> list[str]:
    return asyncio.run(change_adapter(_router(workers), pb.AdapterRequest(**req)))


def test_loading_a_name_already_served_is_refused_and_changes_nothing():
    d0, d1 = Worker("d0", {"sql": "/v1"}), Worker("d1", {"sql": "/v1"})
    with pytest.raises(AdapterChangeFailed) as err:
        _change([d0, d1], name="sql", path="/v2")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and "load_inplace" in err.value.details
    assert d0.calls == d1.calls == [] and d0.loras == d1.loras == {"sql": "/v1"}


def test_a_replacement_one_worker_refuses_changes_no_worker():
    d0 = Worker("d0", {"sql": "/v1"})
    d1 = Worker("d1", {"sql": "/v1"}, refuse=lambda req: req.path == "/v2")
    with pytest.raises(AdapterChangeFailed, match=r"rank 32 > 16 \(refused by d1\)"):
        _change([d0, d1], name="sql", path="/v2", replace=True)
    assert d0.loras == d1.loras == {"sql": "/v1"}  # the adapter both served before, still served
    assert all(c[4] for c in d0.calls + d1.calls)  # only checks were sent


def test_a_replacement_every_worker_accepts_replaces_it_everywhere(_no_redis):
    d0, d1 = Worker("d0", {"sql": "/v1"}), Worker("d1", {"sql": "/v1"})
    assert _change([d0, d1], name="sql", path="/v2", replace=True) == ["d0", "d1"]
    assert d0.loras == d1.loras == {"sql": "/v2"} and _no_redis == [("sql", "/v2")]


def test_a_replacement_refused_after_its_check_leaves_no_second_version():
    d0 = Worker("d0", {"sql": "/v1"})
    d1 = Worker("d1", {"sql": "/v1"}, refuse=lambda req: req.path == "/v2" and not req.check)
    with pytest.raises(AdapterChangeFailed, match="unloaded from d0, which had replaced it"):
        _change([d0, d1], name="sql", path="/v2", replace=True)
    assert d0.loras == {} and d1.loras == {"sql": "/v1"}


def test_a_new_adapter_one_worker_refuses_is_unloaded_from_the_others(_no_redis):
    d0, d1 = Worker("d0", {}), Worker("d1", {}, refuse=lambda req: True)
    with pytest.raises(AdapterChangeFailed, match=r"\(refused by d1\)"):
        _change([d0, d1], name="sql", path="/v1")
    assert d0.loras == {} and d0.calls[-1][2]  # its load undone
    assert _no_redis == []  # not remembered for workers that start later
