"""Disaggregated hand-off latency: time from "prefill done" (the Prefill RPC returned its KV handle)
to "decode started" (the decode stream's first message, token 2), through real worker processes,
real gRPC and real NIXL, for 2k-token prompts. Compared, in the same run, with the decode worker's
own step for token 2 when it already holds the KV (an aggregated request's inter-token time), so
the ratio shows what the KV pull adds.

    python -m bench.pd_handoff [--requests 8] [--prompt-len 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto

MODEL_DIR = Path.home() / ".cache" / "pdserve" / "bench-llama-32m-4k"


def ensure_model() -> Path:
    from engine.tiny_model import LLAMA_32M, create_tiny_model

    if not (MODEL_DIR / "config.json").exists():
        create_tiny_model(MODEL_DIR, "llama", **{**LLAMA_32M, "max_position_embeddings": 4096})
    return MODEL_DIR


def spawn(module: str, model: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    args = [
        sys.executable,
        "-m",
        module,
        "--model",
        str(model),
        "--block-size",
        "16",
        "--num-blocks",
        "1024",
        *extra,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    for line in proc.stdout:
        if line.startswith("LISTENING "):
            return proc, line.split()[1]
    raise RuntimeError(f"{module} exited with {proc.wait()}")


async def one(
    p_addr: str, d_addr: str, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[float, float]:
    """(hand-off seconds, decode inter-token seconds) for one request."""
    async with grpc.aio.insecure_channel(p_addr) as pc, grpc.aio.insecure_channel(d_addr) as dc:
        resp = await pb_grpc.PrefillWorkerStub(pc).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params)),
            timeout=300,
        )
        done = time.perf_counter()
        req = pb.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params), handle=resp.handle
        )
        stamps = []
        async for msg in pb_grpc.DecodeWorkerStub(dc).Decode(req, timeout=300):
            if msg.WhichOneof("kind") == "tokens":
                stamps.append(time.perf_counter())
    return stamps[0] - done, statistics.median(b - a for a, b in itertools.pairwise(stamps))


async def run(args) -> dict:
    model = ensure_model()
    procs = []
    try:
        p_proc, p_addr = spawn("prefill_worker", model)
        d_proc, d_addr = spawn("decode_worker", model)
        procs = [p_proc, d_proc]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        await one(p_addr, d_addr, "warm", list(range(10, 10 + 64)), params)
        handoffs, itls = [], []
        for i in range(args.requests):
            prompt = [(i * 7919 + j * 31) % 8000 + 10 for j in range(args.prompt_len)]  # no prefix reuse
            h, itl = await one(p_addr, d_addr, f"r{i}", prompt, params)
            handoffs.append(h)
            itls.append(itl)
            print(
                f"request {i + 1}/{args.requests}: hand-off {h * 1e3:.1f} ms, decode step {itl * 1e3:.1f} ms",
                file=sys.stderr,
            )
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
    kv_bytes = args.prompt_len * 8 * 2 * 4 * 64 * 4
    result = {
        "prompt_len": args.prompt_len,
        "kv_bytes": kv_bytes,
        "handoff_ms_median": statistics.median(handoffs) * 1e3,
        "handoff_ms_max": max(handoffs) * 1e3,
        "decode_step_ms_median": statistics.median(itls) * 1e3,
    }
    result["handoff_over_decode_step"] = result["handoff_ms_median"] / result["decode_step_ms_median"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    r = asyncio.run(run(args))
    print(
        f"{r['prompt_len']}-token prompt ({r['kv_bytes'] / 2**20:.0f} MiB of KV): prefill done -> decode started "
        f"{r['handoff_ms_median']:.1f} ms median ({r['handoff_ms_max']:.1f} max); a decode step "
        f"{r['decode_step_ms_median']:.1f} ms; hand-off = {r['handoff_over_decode_step']:.2f}x a decode step"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
