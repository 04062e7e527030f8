"""The thinnest streaming server a Python stack can put in front of the engine: a ceiling, not a peer.

One process: the engine loop pdserve's workers run (``EngineLoop``, the same torch threads) and a
raw ASGI app under uvicorn (httptools, uvloop) that answers ``POST /v1/completions`` with OpenAI
completion chunks, one SSE event per token, detokenized incrementally, the usage and ``[DONE]`` in
the last write. Nothing else: no router, no gRPC, no second process, no validation, no API key, no
metrics, no Ray. Whatever a served rate loses against the engine alone on the same cores, this
server loses too, minus everything pdserve does besides streaming; the overhead benchmark runs it
beside ``pdserve serve`` to say how much of the gap any HTTP front would leave on the machine.

    python -m bench.minimal_server [--model DIR] [--port 8100] [--device cuda --dtype bfloat16]

Greedy only (``temperature`` is ignored), EOS ignored when the body says ``ignore_eos``; a client
that disconnects aborts its request, so its blocks come back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
import urllib.request

from bench.ports import free_port
from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_loop import EngineLoop
from settings import gc_policy

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class MinimalApp:
    """ASGI: ``GET /health``, ``GET /v1/models`` and a streamed ``POST /v1/completions``; 404 for
    anything else."""

    def __init__(self, llm: LLM, name: str) -> None:
        self.llm, self.name = llm, name
        self.loop = EngineLoop(llm.core)
        self._ids = itertools.count()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                if kind == "lifespan.shutdown":
                    self.loop.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
                await send({"type": "lifespan.startup.complete"})
        if scope["path"] == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
        elif scope["path"] == "/v1/models":
            models = {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "bench"}]}
            await _respond(send, 200, json.dumps(models).encode())
        elif scope["path"] == "/v1/completions" and scope["method"] == "POST":
            await self.completions(receive, send)
        else:
            await _respond(send, 404, b'{"error":{"message":"not found"}}')

    async def completions(self, receive, send) -> None:
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        req = json.loads(body)
        prompt = req["prompt"]
        prompt = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = SamplingParams(
            temperature=0, max_tokens=int(req.get("max_tokens", 16)), ignore_eos=bool(req.get("ignore_eos"))
        )
        rid = f"min-{next(self._ids)}"
        outputs = self.loop.open_stream(rid)
        detok = IncrementalDetokenizer(self.llm.tokenizer, prompt, params)
        # A disconnect (the only message left to receive) cancels the stream, which aborts the request;
        # uvicorn also answers it once the response is complete, by when ``finished`` is set.
        finished, created = False, int(time.time())
        stream = asyncio.current_task()

        def on_disconnect(_) -> None:
            if not finished:
                stream.cancel()

        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(on_disconnect)
        try:
            await self.loop.run(lambda: self.llm.core.add_request(rid, prompt, params))
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            count = 0
            while not finished:
                out = await outputs.get()
                before = len(detok.text)
                detok.add(out.new_token_ids)
                count += len(out.new_token_ids)
                finished = out.finished
                text = detok.text[before:] + (detok.flush() if finished else "")
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
                event = _sse({**chunk, "choices": [choice]})
                if finished:
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": count}
                    usage["total_tokens"] = len(prompt) + count
                    event += _sse({**chunk, "choices": [], "usage": usage}) + b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": not finished})
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
            self.loop.close_stream(rid)
            if not finished:
                self.loop.call(lambda: self.llm.core.abort_request(rid))


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _respond(send, status: int, body: bytes) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


def serve(model: str, host: str, port: int, device: str = "cpu", dtype: str = "float32") -> None:
    import uvicorn

    print(f"loading {model} on {device} ...", flush=True)
    app = MinimalApp(LLM(model, num_blocks=2048, device=device, dtype=dtype), "minimal")
    app.loop.start()
    gc_policy.settle_heap()  # as every pdserve server process does once it serves
    print(f"serving on http://{host}:{port}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", loop="uvloop", http="httptools")


@contextlib.contextmanager
def minimal_serving(model: str, device: str = "cpu", dtype: str = "float32"):
    """The minimal server in a child process on a free loopback port until the block ends; yields
    its base URL once ``/health`` answers."""
    port = free_port()
    print("\n$ python -m bench.minimal_server", flush=True)
    cmd = [sys.executable, "-m", "bench.minimal_server", "--model", model, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--device", device, "--dtype", dtype])
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"bench.minimal_server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)  # polled until it answers or exits; no fixed wait
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    from cli.tiny_model import ensure_tiny_model

    p = argparse.ArgumentParser(prog="python -m bench.minimal_server", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir or HF id (default: the tiny demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    a = p.parse_args()
    serve(a.model or str(ensure_tiny_model()), a.host, a.port, a.device, a.dtype)


if __name__ == "__main__":
    main()
