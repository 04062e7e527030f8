"""cache_aware vs round_robin end to end: 2 prefill + 1 decode worker processes, a real Redis, the
router's gRPC service, a multi-tenant workload of long shared system prompts.

Each prefill worker's KV pool holds about half of the tenants' system prompts, as a busy production
pool would: routing each tenant to the worker that holds its prefix keeps it cached, spraying
tenants over both workers evicts them. Every policy gets fresh workers (no warm cache carried over)
and the same requests; TTFT is measured at the client from the router's stream.

    python -m bench.router_e2e [--requests 64] [--concurrency 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.ports import free_port
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from registry.cluster_view import ClusterView
from router.router import Router
from router.service import serve

MODEL_DIR = Path.home() / ".cache" / "pdserve" / "bench-llama-35m"


def spawn(module: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    for line in proc.stdout:
        if line.startswith("LISTENING "):
            return proc, line.split()[1]
    raise RuntimeError(f"{module} exited with {proc.wait()}")


def start_redis() -> tuple[subprocess.Popen, str]:
    """A throwaway ``redis-server`` on a free loopback port, no persistence: (process, URL)."""
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise SystemExit("redis-server is required (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tempfile.mkdtemp()],
        stdout=subprocess.DEVNULL,
    )
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process, then wait for each (killed after 20 s)."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def workload(seed: int, tenants: int, requests: int, system_len: int, user_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 8000) for _ in range(system_len)] for _ in range(tenants)]
    return [
        systems[rng.randrange(tenants)] + [rng.randrange(10, 8000) for _ in range(user_len)]
        for _ in range(requests)
    ]


async def run_policy(policy: str, prompts: list[list[int]], args) -> dict:
    redis_proc, url = start_redis()
    procs = [redis_proc]
    try:
        common = ["--model", str(MODEL_DIR), "--redis-url", url, "--block-size", "16"]
        for i in range(2):
            procs.append(
                spawn(
                    "prefill_worker",
                    *common,
                    "--worker-id",
                    f"p{i}",
                    "--num-blocks",
                    str(args.prefill_blocks),
                )[0]
            )
        procs.append(spawn("decode_worker", *common, "--worker-id", "d0", "--num-blocks", "2048")[0])
        view = ClusterView(url, poll_s=0.2)
        view.start()
        while len(view.live_workers()) < 3:
            await asyncio.sleep(0.1)
        router = Router(view, policy)
        server, address = await serve(router)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        ttfts: list[float] = []
        sem = asyncio.Semaphore(args.concurrency)
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.RouterStub(ch)

            async def one(i: int, prompt: list[int]) -> None:
                async with sem:
                    start = time.perf_counter()
                    req = pb.GenerateRequest(
                        request_id=f"{policy}-{i}", prompt_token_ids=prompt, params=params_to_proto(params)
                    )
                    first = None
                    async for msg in stub.Generate(req, timeout=600):
                        if first is None and msg.WhichOneof("kind") == "tokens":
                            first = time.perf_counter() - start
                    ttfts.append(first)
                    print(f"{policy}: {len(ttfts)}/{len(prompts)}", end="\r", file=sys.stderr)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            elapsed = time.perf_counter() - t0
        s = router.stats
        await server.stop(0)
        await router.close()
        view.stop()
    finally:
        stop_all(procs)
    ttfts.sort()
    return {
        "policy": policy,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
        "requests_per_s": len(prompts) / elapsed,
        "prefix_hit_rate": s.delivered_hit_tokens / s.prompt_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-len", type=int, default=384)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--prefill-blocks", type=int, default=128, help="per prefill worker: ~half the tenants' prompts"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from bench.offline_throughput import ensure_model

    ensure_model(MODEL_DIR)
    prompts = workload(0, args.tenants, args.requests, args.system_len, args.user_len)
    results = [asyncio.run(run_policy(pol, prompts, args)) for pol in ("round_robin", "cache_aware")]
    print(file=sys.stderr)
    for r in results:
        print(
            f"{r['policy']:<12} TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms  p90 {r['ttft_p90_s'] * 1e3:7.1f} ms  "
            f"{r['requests_per_s']:.2f} req/s  prefix hit rate {r['prefix_hit_rate']:.0%}"
        )
    rr, ca = results
    ratio = rr["ttft_p90_s"] / ca["ttft_p90_s"]
    print(
        f"cache_aware vs round_robin: TTFT p90 {ratio:.2f}x better, throughput {ca['requests_per_s'] / rr['requests_per_s']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "ttft_p90_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
