"""What ``pdserve bench`` reads from a stream, against a server whose events each test scripts:
every chunk with a choice is a token (its text empty too: a special token, part of a character,
text held back for a stop string), a choice that only finishes is none; one malformed event fails
its request, not the run; a server that sends no usage has its chunks counted and says so; an
open loop keeps ``--max-concurrency`` as a cap on the requests in flight."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from cli.main import build_parser
from loadgen.serving_client import send
from loadgen.serving_datasets import ServingRequest

TOKEN, EMPTY = (
    {"choices": [{"text": "a", "finish_reason": None}]},
    {"choices": [{"text": "", "finish_reason": None}]},
)
FINISH = {"choices": [{"text": "", "finish_reason": "length"}]}


def usage(n: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}


class ScriptedServer:
    """Streams ``script`` (SSE ``data:`` payloads: dicts as JSON, bytes as they are) for every
    completion, each event after the one before it has been sent; records the most in flight."""

    def __init__(self, script: list) -> None:
        self.script, self.in_flight, self.most = script, 0, 0
        self.hold_s = 0.0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if self.hold_s:
                await asyncio.sleep(self.hold_s)  # a request that takes a while: others arrive meanwhile
            for event in self.script:
                data = event if isinstance(event, bytes) else json.dumps(event).encode()
                await resp.write(b"data: " + data + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})


@pytest.fixture
def serve():
    """``serve(script)``: the server's base URL, on a loop of its own in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners = []

    def start(server: ScriptedServer) -> str:
        async def up() -> str:
            app = web.Application()
            app.router.add_post("/v1/completions", server.complete)
            app.router.add_get("/v1/models", server.models)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        return asyncio.run_coroutine_threadsafe(up(), loop).result()

    yield start
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def _send(base: str, prompt=(1, 2, 3)):
    args = SimpleNamespace(temperature=0.0, ignore_eos=False)

    async def one():
        async with aiohttp.ClientSession() as session:
            return await send(
                session, base + "/v1/completions", "fake", ServingRequest(list(prompt), 4), args, {}
            )

    return asyncio.run(one())


def test_empty_text_chunks_are_tokens_and_a_finish_alone_is_not(serve):
    r = _send(serve(ScriptedServer([EMPTY, TOKEN, EMPTY, FINISH, usage(3)])))
    assert r.ok and r.output_tokens == 3 and len(r.itl_s) == 2  # three token chunks: two gaps
    assert r.ttft_s > 0 and not r.usage_missing
    special = _send(serve(ScriptedServer([EMPTY, EMPTY, FINISH, usage(2)])))  # every token special
    assert special.ok and special.output_tokens == 2 and len(special.itl_s) == 1, special.error


@pytest.mark.parametrize(
    ("event", "says"),
    [
        ({"error": "model overloaded"}, "model overloaded"),
        (b"{not json", "bad stream event: JSONDecodeError"),
    ],
)
def test_a_malformed_or_plain_string_error_event_fails_its_request_only(serve, event, says):
    r = _send(serve(ScriptedServer([TOKEN, event, usage(1)])))
    assert not r.ok and r.error.startswith(says), r.error


def test_without_usage_chunks_are_counted_and_the_report_says_so(serve, capsys):
    from loadgen.serving_client import print_report, summarize

    r = _send(serve(ScriptedServer([TOKEN, TOKEN, FINISH])), prompt=range(5))
    assert r.ok and r.usage_missing and r.output_tokens == 2 and r.prompt_tokens == 5
    print_report(summarize([r], 1.0, {}, 1, None))
    assert "1 responses carried no usage" in capsys.readouterr().out


def _bench(base: str, *flags: str) -> dict:
    from loadgen.serving_client import run

    args = build_parser().parse_args(["bench", "--base-url", base, "--no-progress", "--warmup", "0", *flags])
    return run(args)


def test_an_open_loop_keeps_max_concurrency_as_a_cap_on_requests_in_flight(serve):
    server = ScriptedServer([TOKEN, TOKEN, usage(2)])
    server.hold_s = 0.05  # 12 arrivals at 400/s come far faster than one finishes
    result = _bench(serve(server), "--num-prompts", "12", "--request-rate", "400", "--max-concurrency", "2")
    [run] = result["runs"]
    assert server.most == 2 and run["completed"] == 12
    assert run["vllm"]["max_concurrency"] == 2 and run["vllm"]["request_rate"] == 400.0


def test_a_sweep_with_a_rate_or_a_concurrency_is_refused_and_e2el_is_e2e():
    from loadgen.flag_types import goodput_slo
    from loadgen.serving_client import run

    for extra in (["--request-rate", "5"], ["--max-concurrency", "4"]):
        args = build_parser().parse_args(
            ["bench", "--base-url", "http://127.0.0.1:9", "--sweep", "1,2", *extra]
        )
        with pytest.raises(ValueError, match="--sweep runs a closed loop"):
            run(args)
    assert goodput_slo("e2el:2000") == ("e2e", 2000.0)
