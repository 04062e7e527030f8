"""The P/D autoscaler on a running service: a prefill backlog scales prefill up, the idle service
scales it back down (draining), decode held by its bounds; every request still completes."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import yaml
from conftest import API_KEY, ServeProcess

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def prefill_count(svc: ServeProcess) -> int:
    return sum(1 for w in svc.workers() if w.startswith("prefill-"))


def test_prefill_backlog_scales_prefill_up_then_idle_scales_down(serve_model, module_redis_server, tmp_path):
    config = {
        "model": str(serve_model),
        "engine": {"num_blocks": 64},
        "prefill": {"num_replicas": 1, "num_cpus": 0.5},
        "decode": {"num_replicas": 1, "num_cpus": 0.5},
        "autoscaling": {
            "interval_s": 0.5,
            "target_pending_prompt_tokens": 1,  # any backlog at a sample asks for more prefill
            "prefill": {
                "min_replicas": 1,
                "max_replicas": 2,
                "upscale_delay_s": 0,
                "downscale_delay_s": 3,
                "cooldown_s": 1,
            },
            "decode": {"min_replicas": 1, "max_replicas": 1},
        },
    }
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(config))
    svc = ServeProcess(serve_model, module_redis_server.url, "--config", str(path), "--ray-cpus", "8")
    try:
        name = svc.request("GET", "/v1/models")[2]["data"][0]["id"]
        assert prefill_count(svc) == 1

        async def load_until_scaled() -> tuple[int, int]:
            client = openai.AsyncOpenAI(
                base_url=svc.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120
            )
            done = 0
            errors: list[str] = []

            async def one(i: int) -> None:
                nonlocal done
                try:
                    await client.completions.create(
                        model=name, prompt=[5 + i % 50] * 300, max_tokens=4, temperature=0
                    )
                    done += 1
                except openai.APIError as exc:
                    errors.append(str(exc))

            deadline = time.monotonic() + 150
            i = 0
            try:
                while await asyncio.to_thread(prefill_count, svc) < 2:
                    assert time.monotonic() < deadline, "prefill never scaled up"
                    await asyncio.gather(*(one(i + k) for k in range(8)))
                    i += 8
            finally:
                await client.close()
            return done, errors

        done, errors = asyncio.run(load_until_scaled())
        assert done > 0 and errors == []
        deadline = time.monotonic() + 120
        while prefill_count(svc) != 1:  # idle: back to the minimum after the downscale delay
            assert time.monotonic() < deadline, "prefill never scaled back down"
            time.sleep(0.5)
        svc.wait_idle()
    finally:
        assert svc.terminate() == 0
