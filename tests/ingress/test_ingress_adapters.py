"""LoRA adapters at the HTTP edge, driven over ASGI with a router whose cluster state the test sets:
``model`` names the base or an adapter the cluster serves (the adapter goes to the router in the
sampling parameters, and responses echo it); an adapter loaded since the ingress last looked is found
on the first request that names it; any other model is a 404 in OpenAI's schema that lists what is
served; ``/v1/models`` lists the adapters under the base."""

from __future__ import annotations

import asyncio

import pytest
from asgi_client import FedRouter, call, finished, tokens
from test_ingress_edge import _app

from ingress.model_info import load_model_info
from proto import pdserve_pb2 as pb


class AdapterRouter(FedRouter):
    """Streams one token; records the parameters it was asked with; serves ``adapters``."""

    def __init__(self, adapters=()) -> None:
        super().__init__([tokens([5]), finished()])
        self.adapters = list(adapters)
        self.params = []
        self.state_calls = 0

    async def generate(self, rid, prompt, params, priority, timeout_s):
        self.params.append(params)
        async for m in super().generate(rid, prompt, params, priority, timeout_s):
            yield m

    async def cluster_state(self, timeout_s: float = 5.0) -> pb.ClusterState:
        self.state_calls += 1
        return pb.ClusterState(adapters=self.adapters)


@pytest.fixture
def info(tiny_llama):  # per test: the names it learns are its own
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


def _body(model: str, chat: bool = False) -> dict:
    if chat:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return {"model": model, "prompt": "the world", "max_tokens": 1}


def test_a_request_naming_a_served_adapter_runs_it_and_echoes_its_name(info):
    router = AdapterRouter(["sql", "poet"])
    app = _app(info, router)

    async def main():
        r = await call(app, "/v1/completions", _body("sql"))
        assert r.status == 200, r.body
        assert r.json()["model"] == "sql"
        assert router.params[-1].lora == "sql"
        r = await call(app, "/v1/chat/completions", {**_body("poet", chat=True), "stream": True})
        assert r.status == 200 and {e["model"] for e in r.events()} == {"poet"}
        assert router.params[-1].lora == "poet"
        r = await call(app, "/v1/completions", _body("tiny"))
        assert r.json()["model"] == "tiny" and router.params[-1].lora is None

    asyncio.run(main())


def test_an_unknown_model_is_a_404_listing_what_is_served(info):
    router = AdapterRouter(["sql"])
    info.adapters.min_interval_s = 3600.0  # (the default is a second: no test waits on a clock)
    app = _app(info, router)

    async def main():
        r = await call(app, "/v1/completions", _body("nope"))
        assert r.status == 404
        err = r.json()["error"]
        assert (
            err["code"] == "model_not_found" and err["param"] == "model" and err["type"] == "not_found_error"
        )
        assert "'tiny' and the LoRA adapters 'sql'" in err["message"]
        assert router.params == []  # nothing reached the router's Generate
        # Asked again within the interval: the names are not fetched again (a flood of bad names
        # costs the router nothing).
        calls = router.state_calls
        assert (await call(app, "/v1/completions", _body("nope"))).status == 404
        assert router.state_calls == calls

    asyncio.run(main())


def test_an_adapter_loaded_later_is_found_by_the_first_request_naming_it(info):
    router = AdapterRouter([])
    info.adapters.min_interval_s = 0.0  # every miss asks the router (the second is a later load)
    app = _app(info, router)

    async def main():
        assert (await call(app, "/v1/completions", _body("late"))).status == 404
        router.adapters = ["late"]  # loaded on the workers since
        r = await call(app, "/v1/completions", _body("late"))
        assert r.status == 200 and router.params[-1].lora == "late"

    asyncio.run(main())


def test_an_adapter_under_the_base_models_name_is_not_listed_as_a_second_model(info):
    app = _app(info, AdapterRouter(["sql", "tiny"]))

    async def main():
        r = await call(app, "/v1/models")
        assert [c["id"] for c in r.json()["data"]] == ["tiny", "sql"]

    asyncio.run(main())


def test_models_lists_the_adapters_under_the_base(info):
    app = _app(info, AdapterRouter(["sql", "poet"]))

    async def main():
        r = await call(app, "/v1/models")
        cards = r.json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "poet", "sql"]
        assert all(c["parent"] == "tiny" for c in cards[1:]) and "parent" not in cards[0]

    asyncio.run(main())


class LoadingRouter(AdapterRouter):
    """``adapter`` changes the served names as the router's fan-out would, or fails with ``error``."""

    def __init__(self, adapters=(), error: tuple | None = None) -> None:
        super().__init__(adapters)
        self.error = error
        self.changes = []

    async def adapter(self, req):
        import grpc

        name, path, unload = req.name, req.path, req.unload
        self.changes.append((name, path, unload) + (("replace",) if req.replace else ()))
        if self.error is not None:
            code, details = self.error
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
        self.adapters = [a for a in self.adapters if a != name] + ([] if unload else [name])
        return pb.AdapterResponse(workers=["d0", "p0"])


def test_runtime_loading_is_off_unless_allowed(info):
    router = LoadingRouter()
    app = _app(info, router)

    async def main():
        r = await call(app, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a"})
        assert r.status == 404 and "--allow-runtime-lora" in r.json()["error"]["message"]
        assert router.changes == []

    asyncio.run(main())


def test_load_then_use_then_unload_behind_the_api_key(info):
    from ingress.options import IngressOptions

    router = LoadingRouter()
    app = _app(info, router, IngressOptions(allow_runtime_lora=True), api_key="k")
    key = {"Authorization": "Bearer k"}

    async def main():
        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        assert (await call(app, "/v1/load_lora_adapter", body)).status == 401  # no key
        r = await call(app, "/v1/load_lora_adapter", body, key)
        assert r.status == 200 and r.json()["workers"] == ["d0", "p0"], r.body
        assert router.changes == [("sql", "/adapters/sql", False)]
        r = await call(app, "/v1/completions", _body("sql"), key)  # usable at once
        assert r.status == 200 and router.params[-1].lora == "sql"
        r = await call(app, "/v1/unload_lora_adapter", {"lora_name": "sql"}, key)
        assert r.status == 200 and router.changes[-1] == ("sql", "", True)
        assert (await call(app, "/v1/completions", _body("sql"), key)).status == 404
        r = await call(app, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"}, key)
        assert r.status == 400 and r.json()["error"]["param"] == "lora_name"  # the base model's name
        r = await call(app, "/v1/load_lora_adapter", {"lora_name": "x"}, key)
        assert r.status == 400  # no path
        r = await call(app, "/v1/load_lora_adapter", {"lora_name": " x", "lora_path": "/x"}, key)
        assert r.status == 400 and r.json()["error"]["param"] == "lora_name"  # no request could name it
        body = {"lora_name": "sql", "lora_path": "/adapters/sql2", "load_inplace": True}
        assert (await call(app, "/v1/load_lora_adapter", body, key)).status == 200
        assert router.changes[-1] == ("sql", "/adapters/sql2", False, "replace")

    asyncio.run(main())


@pytest.mark.parametrize(
    ("code", "status", "param", "unload"),
    [
        ("INVALID_ARGUMENT", 400, "lora_path", False),
        ("INVALID_ARGUMENT", 400, "lora_name", True),  # an unload refused: the adapter is in use
        ("ALREADY_EXISTS", 400, "lora_name", False),
        ("NOT_FOUND", 404, "lora_name", True),
        ("UNAVAILABLE", 503, None, False),
    ],
)
def test_a_refused_change_is_an_openai_error_with_the_workers_reason(info, code, status, param, unload):
    import grpc

    from ingress.options import IngressOptions

    reason = "adapter 'sql': DoRA adapters are not supported (refused by d0, p0)"
    router = LoadingRouter(error=(getattr(grpc.StatusCode, code), reason))
    app = _app(info, router, IngressOptions(allow_runtime_lora=True))

    async def main():
        path = "/v1/unload_lora_adapter" if unload else "/v1/load_lora_adapter"
        r = await call(app, path, {"lora_name": "sql", **({} if unload else {"lora_path": "/a"})})
        assert r.status == status
        err = r.json()["error"]
        assert err["message"].startswith(reason) and err["param"] == param

    asyncio.run(main())


class UnservedRouter(AdapterRouter):
    """Knows the adapter (the ingress's names are stale) but its workers no longer serve it."""

    async def generate(self, rid, prompt, params, priority, timeout_s):
        import grpc

        details = f"no decode worker that serves the adapter {params.lora!r} is registered"
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
        )
        yield  # (an async generator)


def test_an_adapter_unloaded_behind_the_ingress_is_a_404(info):
    app = _app(info, UnservedRouter(["sql"]))

    async def main():
        r = await call(app, "/v1/completions", _body("sql"))
        assert r.status == 404, r.body
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "'sql'" in err["message"] and err["param"] == "model"

    asyncio.run(main())
