"""How much of the engine's speed the served path keeps, and what each process spends per token.

Every layout gets the same closed loop (N requests, C in flight, fixed input/output lengths, EOS
ignored, greedy), after a few warm-up requests that are not counted:

    engine   the engine alone in this process (``bench.serving_comparisons.engine_closed_loop``)
    engine_staggered  the same, fed one request per step as a served engine is fed
             (``engine_staggered_loop``): what the way requests arrive costs the engine itself
    minimal  ``bench.minimal_server`` in a child process: the thinnest HTTP front a Python stack can be
    stack    ``python -m decode_worker --kv-transfer inprocess``, ``python -m router`` and
             ``python -m ingress --mode aggregated``, each its own process
    split    the same with ``--engine-process``: the decode worker's engine in a process of its own
             (column "core"), nothing else on its GIL
    disagg   ``python -m prefill_worker`` + ``python -m decode_worker`` (NIXL), router, ingress
             ``--mode disaggregated`` (default on for CPU; ``--no-disagg`` leaves it out)
    disagg_split  the same with ``--engine-process`` on both workers (columns "p.core", "core")
    split_rh, disagg_split_rh  split and disagg_split with the router inside the HTTP process
             (``python -m ingress --redis-url``; column "ingress"), as ``pdserve serve`` serves
             by default: no router process, no gRPC hop between them
Standalone processes only (no Ray), all bound to 127.0.0.1, so it runs on a bare GPU host too;
Redis is embedded in this process (fakeredis) unless ``--redis-server PATH`` runs a real one.

CPU per process: utime + stime (``/proc/<pid>/stat``) over the measured load per streamed token; a
layout's total sums its processes, this one (load generator, embedded Redis) apart. After each served
load, every worker's free KV blocks (``GetState``) must be back at their count before the first request.
Under each table, the part of each process's CPU spent on threads besides its main one (registry
publishers, the router's cluster view, NIXL progress, gRPC's; the minimal server's engine thread).
The default model, ``pdserve/zero-cost``, computes nothing: the measured CPU is the stack's own.

    python -m bench.served_path [--workloads 128/128,16/16] [--num-requests 192] [--concurrency 32]
        [--model DIR] [--device cuda --dtype bfloat16] [--quick]    -> bench/results/served_path_*.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from bench.serving_comparisons import engine_closed_loop, engine_staggered_loop
from bench.serving_harness import bench_args
from bench.standalone_stack import (
    HOST,
    Processes,
    check_blocks,
    child_pids,
    engine_stats,
    free_blocks,
    free_port,
    redis,
    wait_http,
)
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.model_names import ZERO_COST, builtin_model_dir
from engine.sampling_params import SamplingParams
from loadgen.serving_client import run_load
from loadgen.serving_datasets import ServingRequest
from loadgen.workloads import random_workload
from settings import gc_policy

RESULTS = Path(__file__).parent / "results"
# The report's columns, in this order; the load generator (this process) is shown apart.
PROCESSES = (
    "engine", "minimal_server", "prefill_worker", "prefill_engine_process", "decode_worker", "engine_process",
    "router", "ingress", "redis",
)  # fmt: skip
SHORT = {
    "minimal_server": "minimal",
    "prefill_worker": "prefill",
    "decode_worker": "decode",
    "engine_process": "core",
    "prefill_engine_process": "p.core",
}
LOADGEN = "load_generator"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
TTFT_TOKENS = 4  # output tokens of the concurrency-1 TTFT requests


@dataclass(frozen=True, slots=True)
class Workload:
    input_len: int
    output_len: int

    @property
    def name(self) -> str:
        return f"{self.input_len}/{self.output_len}"


def parse_workloads(text: str) -> list[Workload]:
    out = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"workload {item!r} is not INPUT/OUTPUT tokens (e.g. 128/128)")
        out.append(Workload(int(parts[0]), int(parts[1])))
    return out


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """utime + stime of all of ``pid``'s threads so far (``/proc/<pid>/stat`` fields 14 and 15); of
    thread ``thread`` alone when given (``/proc/<pid>/task/<thread>/stat``; the main thread's id is
    the pid)."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on; the name may hold spaces
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def prompts(workload: Workload, n: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids in [10, vocab): never a special id. Warm-up and measured prompts differ by
    seed, so the measured ones find nothing in the prefix cache."""
    reqs = random_workload(n, workload.input_len, workload.output_len, vocab_size=vocab, seed=seed)
    return [r.prompt_token_ids for r in reqs]


def measure(
    base: str, model: str, w: Workload, a: argparse.Namespace, vocab: int, pids: dict, stats=None
) -> dict:
    """Warm-up, then the measured closed loop with every process's CPU (and, given ``stats``, a
    callable that reads the serving engine's, its step counts) read around it."""
    load_args = bench_args(base_url=base, model=model, ignore_eos=True, warmup=0, no_progress=True)

    def run(n: int, seed: int) -> dict:
        reqs = [ServingRequest(p, w.output_len) for p in prompts(w, n, vocab, seed)]
        return asyncio.run(run_load(load_args, reqs, a.concurrency, None))

    run(a.warmup, seed=1)
    pids = {**pids, LOADGEN: os.getpid()}
    before, counted = {name: cpu_seconds(pid) for name, pid in pids.items()}, stats and stats()
    main_before = {name: cpu_seconds(pid, pid) for name, pid in pids.items()}
    summary = run(a.num_requests, seed=0)
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    # Each process's threads besides its main one (a registry publisher, the router's cluster view,
    # a NIXL progress thread, gRPC's): their CPU, which the main thread's profile does not show.
    background = {
        name: spent[name] - (cpu_seconds(pid, pid) - main_before[name]) for name, pid in pids.items()
    }
    steps = step_counts(stats(), counted, a.num_requests) if stats else {}
    tokens = round(summary["output_token_throughput"] * summary["duration_s"])
    per_token = {name: s * 1e3 / max(tokens, 1) for name, s in spent.items()}
    complete = summary["completed"] == a.num_requests and tokens == a.num_requests * w.output_len
    if not complete:
        done = f"{summary['completed']}/{a.num_requests} requests, {tokens} tokens"
        print(f"  !!! INCOMPLETE: {done}, errors {summary['errors']}", flush=True)
    summary = {k: v for k, v in summary.items() if k not in ("samples", "vllm")}  # the per-request lists
    one = [ServingRequest(p, TTFT_TOKENS) for p in prompts(w, a.ttft_requests, vocab, seed=2)]
    alone = asyncio.run(run_load(load_args, one, 1, None)) if one else None
    return {
        "ttft_c1_p50_ms": alone["ttft_s"]["median"] * 1e3 if alone else None,
        "requests_per_s": summary["request_throughput"],
        "ttft_p50_ms": summary["ttft_s"]["median"] * 1e3,
        "streamed_tokens": tokens,
        "complete": complete,
        "cpu_ms_per_token": {n: v for n, v in per_token.items() if n != LOADGEN},
        "background_cpu_ms_per_token": {
            n: max(0.0, v) * 1e3 / max(tokens, 1) for n, v in background.items() if n != LOADGEN
        },
        "load_generator_cpu_ms_per_token": per_token[LOADGEN],
        "load": summary,
    } | steps


def engine_ttft(core: EngineCore, measured: list[list[int]]) -> float | None:
    """Median ms from ``add_request`` to the step that returns the request's first token, one
    request at a time (the engine's own TTFT at concurrency 1)."""
    params = SamplingParams(temperature=0, max_tokens=TTFT_TOKENS, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(measured):
        t0 = time.perf_counter()
        core.add_request(f"ttft-{i}", prompt, params)
        first = None
        while core.has_unfinished():
            for out in core.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
        ttfts.append(first * 1e3)
    return statistics.median(ttfts) if ttfts else None


def step_counts(stats, before, num_requests: int) -> dict:
    """Engine steps per measured request and the share replayed from a CUDA graph: a served engine
    fed one request at a time runs more mixed (prompt + decode) steps than a closed loop in one
    process, and a GPU runs those eagerly."""
    steps = stats.num_steps - before.num_steps
    graphs = stats.num_graph_steps - before.num_graph_steps
    return {"steps_per_request": steps / num_requests, "graph_step_share": graphs / steps if steps else 0.0}


def engine_layout(a: argparse.Namespace, model: str, vocab: int, staggered: bool = False) -> dict:
    """The engine alone, fed in cohorts (``engine_closed_loop``) or, ``staggered``, one request per
    step as a served engine is fed (``engine_staggered_loop``): the engine's own cost of how the
    served path delivers requests, apart from the processes around it."""
    loop = engine_staggered_loop if staggered else engine_closed_loop
    engine = {"device": a.device, "dtype": a.dtype, "num_blocks": a.num_blocks, "cpu_threads": a.cpu_threads}
    config = EngineConfig(model=model, **engine, cuda_graph_mixed=a.cuda_graph_mixed)
    core, out = EngineCore(config), {}
    gc_policy.settle_heap()  # the served processes' policy, so the ratios compare like with like
    for w in a.workloads:
        params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
        loop(core, prompts(w, a.warmup, vocab, seed=1), params, concurrency=a.concurrency)
        measured, tokens = prompts(w, a.num_requests, vocab, seed=0), a.num_requests * w.output_len
        t0, before = time.process_time(), core.stats()
        rps = loop(core, measured, params, concurrency=a.concurrency)
        cpu_ms = (time.process_time() - t0) * 1e3 / tokens
        out[w.name] = {"requests_per_s": rps, "ttft_p50_ms": None, "streamed_tokens": tokens}
        out[w.name] |= step_counts(core.stats(), before, a.num_requests)
        out[w.name]["ttft_c1_p50_ms"] = engine_ttft(core, prompts(w, a.ttft_requests, vocab, seed=2))
        out[w.name] |= {"complete": True, "cpu_ms_per_token": {"engine": cpu_ms}}
        print(
            f"  engine{' staggered' * staggered} {w.name}: {rps:.1f} req/s, {cpu_ms:.3f} CPU ms/token",
            flush=True,
        )
    del core
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the workers that follow get the memory
    return out


def minimal_layout(a: argparse.Namespace, model: str, vocab: int) -> dict:
    port = free_port()
    with Processes(a.start_timeout) as procs:
        # NOTE: the minimal server pins 2048 KV blocks and takes torch's threads from OMP_NUM_THREADS.
        cmd = [sys.executable, "-m", "bench.minimal_server", "--model", model, "--port", str(port)]
        cmd += ["--device", a.device, "--dtype", a.dtype]
        procs.start("minimal_server", cmd, env={"OMP_NUM_THREADS": str(a.cpu_threads)})
        base = f"http://{HOST}:{port}"
        name = wait_http(base, procs)
        return {w.name: measure(base, name, w, a, vocab, procs.pids()) for w in a.workloads}


def stack_layout(
    a: argparse.Namespace,
    model: str,
    vocab: int,
    disaggregated: bool,
    engine_process: bool = False,
    router_http: bool = False,
) -> dict:
    engine = ["--model", model, "--device", a.device, "--dtype", a.dtype, "--num-blocks", str(a.num_blocks)]
    engine += [
        "--cpu-threads",
        str(a.cpu_threads),
        "--cuda-graph-mixed" if a.cuda_graph_mixed else "--no-cuda-graph-mixed",
    ]
    workers_only = ["--socket-streams" if a.socket_streams else "--no-socket-streams"]  # and the router
    with redis(a.redis_server, a.start_timeout) as (url, redis_pid), Processes(a.start_timeout) as procs:
        workers: dict[str, str] = {}
        split = ["--engine-process"] * engine_process
        if disaggregated:  # first, so the decode worker warms its NIXL connection to it
            workers["prefill_worker"] = procs.serve(
                "prefill_worker", *engine, *workers_only, "--redis-url", url, *split
            )
        transfer = "nixl" if disaggregated else "inprocess"
        flags = [*engine, *workers_only, "--redis-url", url, "--kv-transfer", transfer]
        workers["decode_worker"] = procs.serve("decode_worker", *flags, *split)
        # ``router_http``: the router inside the HTTP process, as ``pdserve serve`` runs it by default.
        router_flags = ["--redis-url", url, *workers_only]
        route = ["--redis-url", url] if router_http else ["--router", procs.serve("router", *router_flags)]
        mode = "disaggregated" if disaggregated else "aggregated"
        flags = [*route, "--model", model, "--mode", mode, "--port", "0"]
        base = "http://" + procs.serve("ingress", *flags)
        before = {name: free_blocks(addr, name) for name, addr in workers.items()}
        served = wait_http(base, procs)
        pids = procs.pids() | ({"redis": redis_pid} if redis_pid else {})
        if engine_process:
            (pids["engine_process"],) = child_pids(pids["decode_worker"])
            if disaggregated:
                (pids["prefill_engine_process"],) = child_pids(pids["prefill_worker"])
        out = {}
        for w in a.workloads:
            # The decode worker's engine (disaggregated, it computes no prompt: every step decodes).
            stats = functools.partial(engine_stats, workers["decode_worker"])
            prefilled = _prefilled(workers)
            out[w.name] = measure(base, served, w, a, vocab, pids, stats)
            out[w.name]["kv_blocks"] = check_blocks(procs, workers, before)
            if disaggregated:  # the prompts were the prefill worker's (not prefilled where they decode)
                out[w.name]["prefill_worker_prompt_tokens"] = _prefilled(workers) - prefilled
        return out


def _prefilled(workers: dict[str, str]) -> int:
    """Prompt tokens the prefill worker's engine computed so far (0 without one)."""
    address = workers.get("prefill_worker")
    return engine_stats(address, "prefill_worker").prompt_tokens if address else 0


LAYOUTS: dict[str, Callable[[argparse.Namespace, str, int], dict]] = {
    "engine": engine_layout,
    "engine_staggered": functools.partial(engine_layout, staggered=True),
    "minimal": minimal_layout,
    "stack": functools.partial(stack_layout, disaggregated=False),
    "split": functools.partial(stack_layout, disaggregated=False, engine_process=True),
    "disagg": functools.partial(stack_layout, disaggregated=True),
    "disagg_split": functools.partial(stack_layout, disaggregated=True, engine_process=True),
    "split_rh": functools.partial(stack_layout, disaggregated=False, engine_process=True, router_http=True),
    "disagg_split_rh": functools.partial(
        stack_layout, disaggregated=True, engine_process=True, router_http=True
    ),
}


def add_ratios(layouts: dict) -> None:
    """Per layout: its processes' CPU total, its rate over the engine's, its CPU over the minimal's."""
    for r in layouts.values():
        r["stack_cpu_ms_per_token"] = sum(r["cpu_ms_per_token"].values())
    engine, minimal = layouts.get("engine"), layouts.get("minimal")
    # A short run can end inside one clock tick of the minimal server's CPU (/proc counts 10 ms
    # ticks): no ratio then, rather than a division by zero.
    floor = minimal["stack_cpu_ms_per_token"] if minimal else 0.0
    for r in layouts.values():
        r["over_engine"] = r["requests_per_s"] / engine["requests_per_s"] if engine else None
        r["cpu_over_minimal"] = r["stack_cpu_ms_per_token"] / floor if floor > 0 else None


def _num(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(workload: str, layouts: dict, a: argparse.Namespace) -> None:
    procs = [p for p in PROCESSES if any(p in r["cpu_ms_per_token"] for r in layouts.values())]
    head = ["layout", "req/s", "÷engine", "TTFT p50 ms", "TTFT c=1", "steps/req", "graph"]
    rows = [[*head, *(SHORT.get(p, p) for p in procs), "total", "÷minimal", "loadgen"]]
    for name, r in layouts.items():
        rate = [_num(r["requests_per_s"], ".1f"), _num(r["over_engine"], ".2f")]
        rate.append(_num(r["ttft_p50_ms"], ".1f"))
        rate.append(_num(r.get("ttft_c1_p50_ms"), ".1f"))
        rate.append(_num(r.get("steps_per_request"), ".2f"))
        share = r.get("graph_step_share")
        rate.append("-" if share is None else f"{share:.0%}")
        cpu = [_num(r["cpu_ms_per_token"].get(p)) for p in procs]
        totals = [_num(r["stack_cpu_ms_per_token"]), _num(r["cpu_over_minimal"], ".2f")]
        rows.append([name, *rate, *cpu, *totals, _num(r.get("load_generator_cpu_ms_per_token"))])
    where = f"{a.num_requests} requests, {a.concurrency} in flight, {a.device}"
    print(f"\n== {workload} tokens in/out ({where}); CPU ms per streamed token from column 8 on ==")
    widths = [max(len(x) for x in col) for col in zip(*rows)]
    for row in rows:
        print("  ".join(x.rjust(wd) if i else x.ljust(wd) for i, (x, wd) in enumerate(zip(row, widths))))
    loadgen = "this process" + ("" if a.redis_server else " with the embedded Redis")
    print(f"total: the layout's processes summed; loadgen: {loadgen}, not in the total", flush=True)
    for name, r in layouts.items():
        bg = {p: v for p, v in r.get("background_cpu_ms_per_token", {}).items() if v > 0}
        if bg:
            parts = ", ".join(f"{SHORT.get(p, p)} {v:.3f}" for p, v in bg.items())
            print(f"  of which threads besides each process's main one, {name}: {parts}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.served_path", description=__doc__)
    p.add_argument("--model", default=ZERO_COST, help="checkpoint dir, HF id or built-in name (%(default)s)")
    p.add_argument("--device", default="cpu", help="every engine's device (cpu, cuda, cuda:N)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per engine (the minimal server's)")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads of every engine's process")
    p.add_argument(
        "--cuda-graph-mixed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engines replay mixed prefill + decode steps from CUDA graphs (GPU; the engine's default: on)",
    )
    p.add_argument(
        "--socket-streams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers and the router serve their call streams on a plain socket too (their default; off: gRPC only)",
    )
    p.add_argument("--workloads", type=parse_workloads, help="INPUT/OUTPUT tokens, comma-separated")
    p.add_argument("--num-requests", type=int, help="measured requests per workload (192)")
    p.add_argument("--concurrency", type=int, help="requests in flight (32)")
    p.add_argument("--warmup", type=int, help="warm-up requests per workload, not counted (--concurrency)")
    p.add_argument("--ttft-requests", type=int, help="requests one at a time for TTFT c=1 (16; 0: none)")
    p.add_argument("--disagg", action=argparse.BooleanOptionalAction, help="disagg too (default: on CPU)")
    p.add_argument(
        "--layouts",
        default=None,
        help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all; disagg per --disagg)",
    )
    p.add_argument("--redis-server", default=None, help="a redis-server binary (default: embedded Redis)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a process may take to serve")
    p.add_argument("--quick", action="store_true", help="a smoke run: 24 requests, 8 in flight, 16/16")
    p.add_argument("--output", default=None, help="JSON (default: bench/results/served_path_{cpu,gpu}.json)")
    a = p.parse_args(argv)
    a.workloads = a.workloads or parse_workloads("16/16" if a.quick else "128/128,16/16")
    a.num_requests = a.num_requests or (24 if a.quick else 192)
    a.concurrency = a.concurrency or (8 if a.quick else 32)
    a.ttft_requests = a.ttft_requests if a.ttft_requests is not None else (4 if a.quick else 16)
    # A full batch's worth: a GPU engine compiles its kernels for each shape it first meets.
    a.warmup = a.warmup if a.warmup is not None else (4 if a.quick else a.concurrency)
    a.disagg = a.device == "cpu" if a.disagg is None else a.disagg
    a.layouts = a.layouts.split(",") if a.layouts else [n for n in LAYOUTS if "disagg" not in n or a.disagg]
    unknown = set(a.layouts) - set(LAYOUTS)
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    a.output = a.output or str(RESULTS / f"served_path_{'cpu' if a.device == 'cpu' else 'gpu'}.json")
    for flag in ("num_requests", "concurrency", "num_blocks", "cpu_threads"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    t0, load_average = time.perf_counter(), os.getloadavg()  # others' work on these cores skews it all
    model = a.model  # every process resolves a built-in name (engine.model_names) itself
    vocab = transformers.AutoConfig.from_pretrained(builtin_model_dir(model) or model).vocab_size
    by_layout = {}
    for name, layout in LAYOUTS.items():
        if name in a.layouts:
            print(f"\n[{time.perf_counter() - t0:.0f}s] {name} ...", flush=True)
            by_layout[name] = layout(a, model, vocab)
    result = {
        "args": {k: ([w.name for w in v] if k == "workloads" else v) for k, v in vars(a).items()},
        "model": model,
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_average},
        "notes": "CPU ms per streamed token from /proc/<pid>/stat; the load generator (and the embedded "
        "Redis, unless --redis-server) run in the bench process, reported apart from the total",
        "workloads": {},
    }
    for w in a.workloads:
        layouts = {name: runs[w.name] for name, runs in by_layout.items()}
        add_ratios(layouts)
        result["workloads"][w.name] = layouts
        print_table(w.name, layouts, a)
    result["duration_s"] = time.perf_counter() - t0
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {a.output} ({result['duration_s']:.0f}s)", flush=True)
    return result


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the children as Ctrl-C does
    main()
