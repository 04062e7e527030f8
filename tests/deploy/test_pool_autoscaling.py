"""Ray Serve's own autoscaling of a worker pool (``decode.autoscaling``) on a running service: the
router's calls reach the decode workers outside Serve, so the pool must scale on the requests its
engines report (deploy/pool_autoscaling.py): a loaded pool grows to its maximum and is not scaled
down while the load lasts; every request completes and every KV block comes back."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import yaml
from conftest import API_KEY, ServeProcess

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STREAMS = 4  # concurrent requests, against target_ongoing_requests 1 per replica


def decode_count(svc: ServeProcess) -> int:
    return sum(1 for w in svc.workers() if w.startswith("decode-"))


def test_loaded_decode_pool_scales_up_and_stays_up(serve_model, module_redis_server, tmp_path):
    config = {
        "model": str(serve_model),
        "mode": "aggregated",
        "engine": {"num_blocks": 160},
        "decode": {
            "num_cpus": 0.5,
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_ongoing_requests": 1,
                "upscale_delay_s": 0,
                "downscale_delay_s": 2,  # a blind pool would shrink at once
            },
        },
        "ingress": {"http_server": "router"},
    }
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(config))
    svc = ServeProcess(serve_model, module_redis_server.url, "--config", str(path), "--ray-cpus", "6")
    stop = threading.Event()
    done = [0] * STREAMS
    errors: list[str] = []
    try:
        name = svc.request("GET", "/v1/models")[2]["data"][0]["id"]
        assert decode_count(svc) == 1

        def load(i: int) -> None:
            while not stop.is_set():
                body = {"model": name, "prompt": f"stream {i}", "max_tokens": 300, "ignore_eos": True}
                req = urllib.request.Request(
                    svc.base + "/v1/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=120) as resp:
                        resp.read()
                    done[i] += 1
                except OSError as exc:
                    errors.append(f"stream {i}: {exc}")
                    return

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while decode_count(svc) < 2:  # Serve reads the engines' load: the pool grows
            assert not errors, errors
            assert time.monotonic() < deadline, (
                f"decode never scaled up under {STREAMS} streams (target 1 per replica): {svc.workers()}"
            )
            time.sleep(0.5)
        # While the load lasts (each stream finishes another request), the pool stays at its maximum.
        counts, after = [], list(done)
        while any(d <= a for d, a in zip(done, after, strict=True)):
            assert not errors, errors
            counts.append(decode_count(svc))
            time.sleep(0.5)
        assert min(counts) == 2, f"decode scaled down under load: counts {counts}"
        stop.set()
        for t in threads:
            t.join(120)
        assert not errors, errors
        svc.wait_idle()
    finally:
        stop.set()
        assert svc.terminate() == 0
