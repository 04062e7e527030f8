"""KV streamed while the prompt is computed vs the whole-request pull, in one run.

One prefill and one decode worker process, a real Redis, the router's gRPC service; requests one at
a time (no queueing), each with a fresh prompt (no prefix reuse), the two modes alternating request
by request so that both see the same machine. The prefill worker computes prompts in chunks of
``--chunk`` tokens (the same in both modes).

- ``whole``: today's path. The prefill returns its handle; the decode worker pulls every block.
- ``streamed`` (router ``kv_streaming_tokens``): the decode worker reads each chunk's blocks while
  the next chunk is computed; after the first token only the last chunk's blocks are left.

Measured at the client, from the router's stream: TTFT (first token), hand-off (first token ->
second token: the pull left after the prefill plus the first decode step) and a decode step (the
median gap between later tokens). From the decode worker: the pull time left after the complete
handle came (its hop timing), and the bytes read while the prompt was still being computed.

    python -m bench.kv_streaming [--lengths 2048 8192] [--requests 6] [--chunk 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import grpc

from bench.router_e2e import spawn, start_redis, stop_all
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from registry.cluster_view import ClusterView
from router.router import Router
from router.service import serve

MODEL_DIR = Path.home() / ".cache" / "pdserve" / "bench-llama-32m-16k"
MODES = ("whole", "streamed")


def ensure_model() -> Path:
    from engine.tiny_model import LLAMA_32M, create_tiny_model

    if not (MODEL_DIR / "config.json").exists():
        create_tiny_model(MODEL_DIR, "llama", **{**LLAMA_32M, "max_position_embeddings": 16384})
    return MODEL_DIR


async def one(stub, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    stamps: list[float] = []
    kv_ms = None
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params))
    async for msg in stub.Generate(req, timeout=900):
        kind = msg.WhichOneof("kind")
        if kind == "tokens":
            stamps.extend([time.perf_counter()] * len(msg.tokens.token_ids))
        elif kind == "finished" and msg.finished.timing.HasField("kv_transfer_ms"):
            kv_ms = msg.finished.timing.kv_transfer_ms
        elif kind == "error":
            raise RuntimeError(msg.error.message)
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    return {
        "ttft_ms": (stamps[0] - start) * 1e3,
        "handoff_ms": (stamps[1] - stamps[0]) * 1e3,
        "decode_step_ms": statistics.median(gaps) * 1e3,
        "pull_after_prefill_ms": kv_ms,
    }


async def decode_stats(address: str) -> pb.KVTransferStats:
    async with grpc.aio.insecure_channel(address) as ch:
        state = await pb_grpc.DecodeWorkerStub(ch).GetState(pb.GetStateRequest(), timeout=10)
    return state.transfer_stats


async def run(args) -> dict:
    model = ensure_model()
    redis_proc, url = start_redis()
    procs = [redis_proc]
    blocks = str(max(args.lengths) // 16 * 2 + 64)
    common = ["--model", str(model), "--redis-url", url, "--block-size", "16", "--num-blocks", blocks]
    chunk = ["--max-num-batched-tokens", str(args.chunk)]
    results: dict = {"chunk": args.chunk, "lengths": {}}
    try:
        procs.append(spawn("prefill_worker", *common, *chunk, "--worker-id", "p0")[0])
        procs.append(spawn("decode_worker", *common, "--worker-id", "d0")[0])
        view = ClusterView(url, poll_s=0.2)
        view.start()
        while len(view.live_workers()) < 2:
            await asyncio.sleep(0.1)
        router = Router(view, "round_robin")
        server, address = await serve(router)
        decode_address = view.live_workers("decode")[0].address
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.RouterStub(ch)
            for mode in MODES:  # warm-up: connections, NIXL peers, first-call costs
                router.kv_streaming_tokens = 1 if mode == "streamed" else 0
                await one(stub, f"warm-{mode}", list(range(10, 10 + 2 * args.chunk)), params)
            for length in args.lengths:
                rows: dict[str, list[dict]] = {m: [] for m in MODES}
                before = await decode_stats(decode_address)
                for i in range(args.requests):
                    for mode in MODES if i % 2 == 0 else MODES[::-1]:
                        router.kv_streaming_tokens = 1 if mode == "streamed" else 0
                        seed = len(rows["whole"]) + len(rows["streamed"]) + length
                        prompt = [(seed * 7919 + j * 31) % 8000 + 10 for j in range(length)]
                        r = await one(stub, f"{length}-{mode}-{i}", prompt, params)
                        rows[mode].append(r)
                        print(
                            f"{length} tokens, {mode} {i + 1}/{args.requests}: TTFT {r['ttft_ms']:.0f} ms, "
                            f"hand-off {r['handoff_ms']:.1f} ms",
                            file=sys.stderr,
                        )
                after = await decode_stats(decode_address)
                results["lengths"][str(length)] = summarize(rows, before, after, length)
        await server.stop(0)
        await router.close()
        view.stop()
    finally:
        stop_all(procs)
    return results


def summarize(rows: dict[str, list[dict]], before, after, length: int) -> dict:
    out: dict = {}
    for mode, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in rs[0]}
        med["handoff_ms_p90"] = sorted(r["handoff_ms"] for r in rs)[int(0.9 * (len(rs) - 1))]
        out[mode] = med
    out["kv_bytes_per_request"] = (after.bytes - before.bytes) / (2 * len(rows["whole"]))
    out["overlapped_fraction"] = (after.streamed_bytes - before.streamed_bytes) / max(
        1, (after.bytes - before.bytes) / 2
    )
    w, s = out["whole"], out["streamed"]
    out["handoff_ratio"] = w["handoff_ms"] / s["handoff_ms"]
    out["ttft_ratio"] = w["ttft_ms"] / s["ttft_ms"]
    out["prompt_len"] = length
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(results["lengths"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in (
        (axes[0], "handoff_ms", "hand-off: first token -> second (ms)"),
        (axes[1], "ttft_ms", "TTFT (ms)"),
    ):
        for k, mode in enumerate(MODES):
            vals = [results["lengths"][n][mode][key] for n in lengths]
            xs = [i + (k - 0.5) * 0.38 for i in range(len(lengths))]
            ax.bar(xs, vals, width=0.38, label=mode)
            for x, v in zip(xs, vals):
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n}-token prompt" for n in lengths])
        ax.set_title(title, fontsize=10)
    axes[0].legend()
    fig.suptitle(f"KV streamed while prefilled vs whole-request pull (chunks of {results['chunk']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--requests", type=int, default=6, help="per mode and prompt length")
    p.add_argument("--chunk", type=int, default=512, help="the prefill worker's max_num_batched_tokens")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    results = asyncio.run(run(args))
    print(f"prefill chunks of {args.chunk} tokens; medians over {args.requests} requests per mode")
    print(
        f"{'prompt':>7} {'mode':>9} {'TTFT ms':>9} {'hand-off ms':>12} {'p90':>7} {'step ms':>8} {'pull left ms':>13}"
    )
    for n, r in results["lengths"].items():
        for mode in MODES:
            m = r[mode]
            print(
                f"{n:>7} {mode:>9} {m['ttft_ms']:9.0f} {m['handoff_ms']:12.1f} {m['handoff_ms_p90']:7.1f} "
                f"{m['decode_step_ms']:8.1f} {m.get('pull_after_prefill_ms', float('nan')):13.1f}"
            )
        print(
            f"{n:>7}: hand-off {r['handoff_ratio']:.2f}x shorter streamed, TTFT ratio (whole/streamed) "
            f"{r['ttft_ratio']:.2f}, {r['kv_bytes_per_request'] / 2**20:.0f} MiB of KV per request, "
            f"{r['overlapped_fraction']:.0%} of it read during the prefill"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
