"""The demo's streams against a small SSE server the test runs: the base prompts under the served
model, then the adapter prompt under the base and each LoRA adapter, by name; and the trained
adapters are found only once pdserve train-lora has made them for the trained target."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from cli import train_lora, train_tiny
from cli.demo import ADAPTER_PROMPT, DEMO_PROMPTS, run_demo


class _SSE(BaseHTTPRequestHandler):
    asked: ClassVar[list[tuple[str, str]]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.asked.append((body["model"], body["prompt"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in (" a", " b"):
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_the_demo_runs_the_adapter_prompt_under_the_base_and_each_adapter(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run_demo(f"http://127.0.0.1:{server.server_port}", "base", None, adapters=["asyncio", "unittest"])
    finally:
        server.shutdown()
    tail = [(m, ADAPTER_PROMPT) for m in ("base", "asyncio", "unittest")]
    assert _SSE.asked == [("base", p) for p in DEMO_PROMPTS] + tail
    assert "[unittest] import" in capsys.readouterr().out


def test_trained_adapters_are_found_only_once_made(tmp_path, monkeypatch):
    target = tmp_path / "tiny" / "target"
    monkeypatch.setattr(train_tiny, "trained_target", lambda: target)
    monkeypatch.setattr(train_lora, "CACHE", tmp_path / "lora")
    assert train_lora.trained_adapters() is None
    done = tmp_path / "lora" / train_lora.LoraRecipe().key(target) / "metrics.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"adapters": {"asyncio": {"path": "/a"}, "unittest": {"path": "/e"}}}))
    assert train_lora.trained_adapters() == {"asyncio": "/a", "unittest": "/e"}
