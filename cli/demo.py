"""``pdserve serve --demo``: a few streamed requests through the whole path, with their timings.

Each request goes HTTP -> ingress -> router -> prefill -> NIXL -> decode and back as SSE; the demo
prints the text as it streams, then the request's TTFT and inter-token latency measured here, at
the client.
"""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

DEMO_PROMPTS = [
    "the world is",
    "there was a man who",
    "in the first years of the new state",
    "what people know about life",
]


def stream_sse(
    base_url: str, path: str, payload: dict, api_key: str | None, timeout_s: float = 120.0
) -> Iterator[dict]:
    """POST ``payload`` with stream=true and yield each SSE event's JSON until ``[DONE]``."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout_s)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", path, body=json.dumps({**payload, "stream": True}), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            yield event
    finally:
        conn.close()


ADAPTER_PROMPT = "import "  # the trained adapters (pdserve train-lora) each continue it their way


def run_demo(
    base_url: str, model: str, api_key: str | None, max_tokens: int = 24, adapters: list[str] = ()
) -> None:
    """The demo's streams; ``adapters``: LoRA adapters served too (one prompt under the base model,
    then under each adapter)."""
    print(f"demo: {len(DEMO_PROMPTS)} streamed completions through prefill -> NIXL -> decode\n")
    for prompt in DEMO_PROMPTS:
        _stream_one(base_url, model, prompt, api_key, max_tokens)
    if adapters:
        print(
            f"demo: one prompt under the base model, then under each LoRA adapter ({', '.join(adapters)})\n"
        )
        for name in (model, *adapters):
            _stream_one(base_url, name, ADAPTER_PROMPT, api_key, max_tokens, label=f"[{name}] ")


def _stream_one(base_url: str, model: str, prompt: str, api_key, max_tokens: int, label: str = "") -> None:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    print(f"> {label}{prompt}", flush=True)
    print("  ", end="", flush=True)
    for event in stream_sse(base_url, "/v1/completions", payload, api_key):
        for choice in event["choices"]:
            if choice["text"]:
                stamps.append(time.perf_counter())
                print(choice["text"], end="", flush=True)
    ttft = (stamps[0] - t0) * 1000 if stamps else float("nan")
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    itl = f"{statistics.mean(gaps):.1f} ms mean, {max(gaps):.1f} ms max" if gaps else "n/a"
    print(f"\n  TTFT {ttft:.0f} ms · ITL {itl} · {len(stamps)} chunks\n", flush=True)
