"""The planner's predictions against real ``pdserve serve`` deployments on this machine (issue 34).

For each layout (aggregated 1 worker, 1P+1D, 1P+2D) and each traffic mix (plain, prefix-heavy):

1. the mix's trace (``planner.traffic``: Poisson arrivals, prompt and output lengths, shared
   prefixes) is generated once, the same requests for every layout;
2. ``pdserve serve`` runs the layout; after a warm-up (a trace of another seed, then a few
   unrelated prompts before each mix), the trace is replayed
   open loop over HTTP (each request sent at its arrival time, greedy, ``ignore_eos``, streamed),
   and TTFT, the gaps between streamed chunks and the end of every request are taken at the client;
3. the simulator replays the same requests over the same layout with the profile measured here
   (``planner.profile`` on the engine, at the torch threads each of the layout's workers gets);
4. per metric (TTFT p50/p90, ITL p50, throughput): ``(predicted - measured) / measured``; per hop
   (prefill queue and compute, KV transfer, decode queue), the measured median beside the
   simulator's (``planner.simulator.hop_medians``).

``bench.speed_probe`` times the same small engine workload around each profile, each served
overhead and each replay (``speed_s``): this VM's speed moves by 1.4x within minutes, and a profile
taken at one speed predicts a replay run at another that much off.

The profile covers the engine's steps and KV transfers; everything else on the served path (HTTP,
tokenization, gRPC hops between ingress, router and workers, streaming) is not in it, and on this
2-core machine the front end shares the cores with the engines. The errors say how much that is.

``--model pdserve/emulated`` runs it on an emulated accelerator (``engine.model_names``): every
engine step sleeps as long as its work would take on one, so the engines' time dominates the
host's, as on a GPU host, and what is left is the simulator's model of the deployment (queueing,
batching, routing, transfers, the front end) rather than the engines' shared cores.

    python -m bench.planner_validation [--quick] [--model PATH | pdserve/emulated] [--load 0.5]
    python -m bench.planner_validation --replay results/planner_validation.json --output OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.offline_throughput import DEFAULT_MODEL_DIR, ensure_model
from bench.serving_harness import bench_args, serving
from bench.speed_probe import SpeedProbe
from engine.model_names import builtin_model_dir
from ingress.request_timing import DEBUG_HEADER
from loadgen.serving_client import send
from loadgen.serving_datasets import ServingRequest
from planner import host_cpu
from planner.busy_probes import median_error, probe_errors
from planner.costs import ModelProfile, ServedOverhead
from planner.profile import Grid, profile_engine
from planner.served import Client, fit_overhead, measure_served
from planner.simulator import Deployment, SimRequest, Simulator, hop_medians, summarize
from planner.traffic import Lengths, Traffic

RESULTS = Path(__file__).parent / "results"
NUM_BLOCKS = 1024
METRICS = ("ttft_p50", "ttft_p90", "itl_p50", "throughput")
HOPS_SHOWN = (
    "ttft",
    "prefill_queue",
    "prefill_compute",
    "kv_transfer",
    "decode_queue",
    "decode_first_step",
)  # printed per mix
CLIENT = bench_args(ignore_eos=True)  # greedy (temperature 0), every output as long as asked


@dataclass(frozen=True)
class Layout:
    name: str
    prefill: int
    decode: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def flags(self) -> list[str]:
        if self.prefill == 0:
            return ["--mode", "aggregated", "--decode", str(self.decode)]
        return ["--prefill", str(self.prefill), "--decode", str(self.decode), "--local-prefill-tokens", "0"]


LAYOUTS = (Layout("aggregated", 0, 1), Layout("1P+1D", 1, 1), Layout("1P+2D", 1, 2))


def mixes(quick: bool) -> dict[str, tuple[Traffic, float]]:
    """Each mix, and its load as a share of what one aggregated worker completes (the profile's)."""
    n = 24 if quick else 48
    plain = Traffic(rate=1.0, requests=n, prompt=Lengths(128, 0.5), output=Lengths(32, 0.5), seed=1)
    prefix = replace(plain, prompt=Lengths(288, 0.1), prefix_groups=4, prefix_tokens=256, seed=2)
    overload = replace(plain, requests=2 * n, seed=3)
    return {"plain": (plain, 0.5), "prefix-heavy": (prefix, 0.5), "overload": (overload, 1.5)}


def measure_profile(model: str, threads: int, quick: bool) -> ModelProfile:
    """The engine's costs at ``threads`` torch threads (what each worker of a layout runs with)."""
    from engine import EngineConfig, EngineCore

    torch.set_num_threads(threads)
    grid = Grid(
        prefill_lengths=(32, 128, 256, 384) if not quick else (32, 128, 320),
        cached_shares=(0.0, 0.8),
        decode_batches=(1, 4, 8, 16, 32, 64) if not quick else (1, 4, 12),  # overload runs 64 and more
        decode_contexts=(64, 256) if not quick else (128,),
        transfer_blocks=(1, 4, 16, 32),
        repeats=3 if not quick else 2,
        decode_steps=8,
    )
    core = EngineCore(EngineConfig(model=model, num_blocks=NUM_BLOCKS, cpu_threads=threads))
    for attempt in range(3):  # a profile taken while something else ran fits its samples badly
        print(f"profiling at {threads} torch thread(s) ...", flush=True)
        profile = profile_engine(
            core, model, grid, transfer=True, progress=lambda line: print(f"  {line}", flush=True)
        )
        warnings = profile.fit_warnings()
        if not warnings:
            break
        print(f"  {'; '.join(warnings)}" + (": again" if attempt < 2 else ": kept"), flush=True)
    return profile


def saturated_throughput(profile: ModelProfile, traffic: Traffic, vocab: int) -> float:
    """Requests per second one aggregated worker completes when everything arrives at once."""
    reqs = [replace(r, arrival=0.0) for r in traffic.generate(vocab)]
    return summarize(Simulator(profile, Deployment(0, 1)).run(reqs)).throughput


async def _one(
    session, url: str, model: str, req: SimRequest, start: float, hops: list | None = None
) -> SimRequest:
    """``req`` sent at its arrival time by the load generator's client; its chunks' times (from
    ``start``): the first chunk is the first token, each later chunk one gap, as a client sees them."""
    await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
    sent = time.perf_counter() - start
    headers = {DEBUG_HEADER: "timing"} if hops is not None else {}
    res = await send(session, url, model, ServingRequest(req.prompt, req.output_len), CLIENT, headers)
    if not res.ok:
        raise RuntimeError(f"a request failed: {res.error}")
    times = list(itertools.accumulate([sent + res.ttft_s, *res.itl_s]))
    if hops is not None and res.timing_ms:
        hops.append(res.timing_ms)
    return SimRequest(req.arrival, req.prompt, len(times), first_token=times[0], token_times=times)


async def replay(base: str, requests: list[SimRequest], hops: list | None = None) -> list[SimRequest]:
    """``requests`` sent at their arrival times; with ``hops`` (a list), each also asks the server
    for its hop timing (``x-pdserve-debug: timing``) and its ms per hop are appended there."""
    import aiohttp

    url = base + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        async with s.get(base + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        warm = random.Random(99)
        vocab = max(max(r.prompt) for r in requests) + 1
        warmup = [SimRequest(0.0, [warm.randrange(10, vocab) for _ in range(64)], 8) for _ in range(4)]
        await asyncio.gather(*(_one(s, url, model, r, time.perf_counter()) for r in warmup))
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(s, url, model, r, start, hops) for r in requests)))


def errors(real: dict, sim: dict) -> dict:
    return {m: (sim[m] - real[m]) / real[m] for m in METRICS if real[m] > 0}


def run(args: argparse.Namespace) -> dict:
    model = str(builtin_model_dir(args.model) or ensure_model(Path(args.model)))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    cores = len(os.sched_getaffinity(0))
    probe = SpeedProbe(model)
    profiles, speeds = {}, {}  # speeds: the probe's seconds around each measurement
    for layout in LAYOUTS:
        threads = max(1, cores // layout.workers)  # cli.host_share.local_cpu_threads' share
        if threads not in profiles:
            profiles[threads], speeds[threads] = probe.around(
                functools.partial(measure_profile, model, threads, args.quick)
            )
            print(f"  speed probe around the profile: {speeds[threads] * 1e3:.0f} ms", flush=True)
    agg = profiles[max(1, cores)]
    traffic = {}
    for name, (t, share) in mixes(args.quick).items():
        rate = share * args.load * saturated_throughput(agg, t, vocab)
        traffic[name] = replace(t, rate=rate)
        print(f"{name}: {t.requests} requests at {rate:.2f}/s", flush=True)
    rows, overheads, probes = [], {}, {}
    for layout in LAYOUTS:
        engine_only = profiles[max(1, cores // layout.workers)]
        flags = ["--model", model, "--num-blocks", str(NUM_BLOCKS), "--worker-cpus", "0.5", *layout.flags()]
        with serving(*flags) as base:
            # A fresh deployment runs its first minute slower (Ray settling on the same 2 cores: the
            # same 48 requests' prefill hop took 83 ms right after start and 31 ms a minute later).
            # The simulator models the steady state: warm up with a trace of another seed first.
            warm = replace(traffic["plain"], seed=99)
            print(f"warming up: {warm.requests} requests of another seed ...", flush=True)
            cpu0 = time.process_time()
            tokens = sum(len(r.token_times) for r in asyncio.run(replay(base, warm.generate(vocab))))
            client_cpu = (time.process_time() - cpu0) / tokens
            print(f"  the load generator's CPU: {client_cpu * 1e3:.3f} ms per streamed token", flush=True)
            print("measuring the served path's overhead (pdserve profile --served) ...", flush=True)
            over, over_speed = probe.around(
                functools.partial(
                    measure_served,
                    Client(base),
                    engine_only,
                    repeats=2 if args.quick else 3,
                    progress=_indent,
                    host_usage=host_cpu.usage,
                    busy_streams=4,  # the busy probes: a check of the shared-core model
                )
            )
            overheads[layout.name] = over.to_json() | {
                "load_generator_cpu_per_token_s": client_cpu,
                "speed_s": over_speed,
            }
            served = replace(engine_only, served={_mode(layout): with_load_generator(over, client_cpu)})
            probes[layout.name] = busy_check(served, layout, cores)
            print(_busy_line(layout.name, probes[layout.name]), flush=True)
            for name, t in traffic.items():
                requests = t.generate(vocab)
                before_speed = probe.seconds()
                before, t0, c0 = host_cpu.usage(), time.perf_counter(), time.process_time()
                hops: list[dict] = []
                real = summarize(asyncio.run(replay(base, requests, hops))).as_dict()
                span = time.perf_counter() - t0
                busy = host_cpu.cores_between(before, host_cpu.usage(), span)
                busy["load_generator"] = (time.process_time() - c0) / span
                row = {"layout": layout.name, "mix": name, "rate": t.rate, "measured": real, "cores": busy}
                row["speed_s"] = {
                    "profile": speeds[max(1, cores // layout.workers)],
                    "overhead": over_speed,
                    "replay": statistics.fmean((before_speed, probe.seconds())),
                }
                row["hops_ms_p50"] = {
                    k: statistics.median(h[k] for h in hops if k in h) for k in {k for h in hops for k in h}
                }
                predict(row, layout, engine_only, served, cores, t.generate(vocab))
                rows.append(row)
                print(_line(row), flush=True)
                print(_cores_line(busy), flush=True)
                sp = row["speed_s"]
                print(
                    f"  speed probe (ms): profile {sp['profile'] * 1e3:.0f}, served overhead "
                    f"{sp['overhead'] * 1e3:.0f}, this replay {sp['replay'] * 1e3:.0f}",
                    flush=True,
                )
                print(_hops_line(row), flush=True)
    return {
        "model": model,
        "cores": cores,
        "profiles": {str(k): p.to_json() for k, p in profiles.items()},
        "served_overheads": overheads,
        "traffic": {k: asdict(v) for k, v in traffic.items()},
        "rows": rows,
        "busy_probes": probes,
    }


def predict(row: dict, layout: Layout, engine_only, served, cores: int, requests: list[SimRequest]) -> None:
    """The simulator's predictions for ``row``'s measured run: from the engine profile alone, and with
    the served path's overhead on cores shared by workers and front end."""
    for key, profile, shared in (("engine_only", engine_only, None), ("served", served, cores)):
        dep = Deployment(layout.prefill, layout.decode, host_cores=shared)
        fresh = [SimRequest(r.arrival, r.prompt, r.output_len) for r in requests]
        sim = summarize(Simulator(profile, dep).run(fresh)).as_dict()
        hops = hop_medians(fresh, layout.prefill > 0)
        row[key] = {"predicted": sim, "error": errors(row["measured"], sim), "hops_ms_p50": hops}


def busy_check(served: ModelProfile, layout: Layout, cores: int) -> dict | None:
    """The simulator against the layout's busy probes (``planner.busy_probes``): its TTFT error per
    probe (prompts sent while 4 long requests decode), and their median; None: none measured."""
    errs = probe_errors(served, Deployment(layout.prefill, layout.decode, host_cores=cores))
    return None if errs is None else {"median_error": median_error(errs), "errors": errs}


def _busy_line(name: str, check: dict | None) -> str:
    if check is None:
        return f"  busy probes ({name}): not measured"
    worst = max(check["errors"], key=abs)
    return (
        f"  busy probes ({name}): the simulator's TTFT {check['median_error']:+.0%} (median), "
        f"worst {worst:+.0%}, over {len(check['errors'])} prompts beside 4 decoding"
    )


def replay_stored(result: dict) -> dict:
    """``result`` (a stored run) predicted again by this simulator: the same profiles, traffic and
    measurements; each served overhead refitted from its samples (``fit_overhead`` as it is now)."""
    profiles = {int(k): ModelProfile.from_json(v) for k, v in result["profiles"].items()}
    vocab = next(iter(profiles.values())).model["vocab_size"]
    traffic = {name: Traffic.from_dict(t) for name, t in result["traffic"].items()}
    by_name = {layout.name: layout for layout in LAYOUTS}
    probes: dict[str, dict | None] = {}
    for row in result["rows"]:
        layout = by_name[row["layout"]]
        engine_only = profiles[max(1, result["cores"] // layout.workers)]
        stored = result["served_overheads"][layout.name]
        over = fit_overhead(stored["samples"])
        client_cpu = stored.get("load_generator_cpu_per_token_s", 0.0)
        result["served_overheads"][layout.name] = over.to_json() | {
            "load_generator_cpu_per_token_s": client_cpu
        }
        served = replace(engine_only, served={_mode(layout): with_load_generator(over, client_cpu)})
        requests = traffic[row["mix"]].generate(vocab)
        predict(row, layout, engine_only, served, result["cores"], requests)
        if layout.name not in probes:  # one check per layout, not per mix
            probes[layout.name] = busy_check(served, layout, result["cores"])
    result["busy_probes"] = probes
    return result


def with_load_generator(over: ServedOverhead, cpu_per_token_s: float) -> ServedOverhead:
    """The front end's CPU plus the load generator's: here it runs on the deployment's cores too (a
    user's clients would not), and the simulator is to predict what was measured."""
    if not (over.cpu_per_request_s or over.cpu_per_token_s):
        return over  # not measured: the latency terms stand in for the front end's CPU
    return replace(over, cpu_per_token_s=over.cpu_per_token_s + cpu_per_token_s)


def _mode(layout: Layout) -> str:
    return "aggregated" if layout.prefill == 0 else "disaggregated"


def _cores_line(cores: dict) -> str:
    engines = " + ".join(f"{c:.2f}" for c in cores["engines"])
    return (
        f"  cores busy: machine {cores['machine']:.2f} = engines {engines} + front end {cores['front']:.2f}"
        f" + load generator {cores['load_generator']:.2f}"
    )


def _hops_line(row: dict) -> str:
    """Measured hop medians, and the simulator's beside each where it tells that hop apart."""
    real, sim = row["hops_ms_p50"], row["served"].get("hops_ms_p50", {})
    shown = [k for k in HOPS_SHOWN if k in real]
    parts = [f"{k} {real[k]:.1f}" + (f" (sim {sim[k]:.1f})" if k in sim else "") for k in shown]
    return "  hops p50 (ms): " + ", ".join(parts)


def _indent(line: str) -> None:
    print(f"  {line}", flush=True)


def _line(row: dict, key: str = "served") -> str:
    parts = [f"{row['layout']:10s} {row['mix']:12s}"]
    for m in METRICS:
        real, sim = row["measured"][m], row[key]["predicted"][m]
        scale = 1000 if m != "throughput" else 1
        parts.append(f"{m} {real * scale:6.1f} vs {sim * scale:6.1f} ({row[key]['error'].get(m, 0):+4.0%})")
    return "  ".join(parts)


def plot(result: dict, path: Path) -> None:
    """Predicted against measured per metric: hollow markers the engine-only profile, filled ones
    with the served path's overhead and shared cores; the band is the 15% target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.4 * len(METRICS), 4.4))
    markers = {"plain": "o", "prefix-heavy": "s", "overload": "^"}
    colors = {"aggregated": "tab:blue", "1P+1D": "tab:orange", "1P+2D": "tab:green"}
    for ax, m in zip(axes, METRICS, strict=True):
        values = []
        for row in result["rows"]:
            real = row["measured"][m]
            for key, fill in (("engine_only", "none"), ("served", colors[row["layout"]])):
                sim = row[key]["predicted"][m]
                values += [real, sim]
                label = f"{row['layout']}, {row['mix']}" if key == "served" else None
                ax.scatter(
                    real,
                    sim,
                    marker=markers[row["mix"]],
                    facecolors=fill,
                    edgecolors=colors[row["layout"]],
                    label=label,
                )
        xs = [min(values) * 0.8, max(values) * 1.2]
        ax.plot(xs, xs, color="black", lw=0.8)
        ax.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="green", alpha=0.12)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
        ax.set_title(m + (" (s)" if m != "throughput" else " (req/s)"))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle(
        "simulator vs real pdserve serve (hollow: engine profile only; filled: + served path, shared cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.planner_validation", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer requests and a smaller profile grid")
    p.add_argument(
        "--model",
        default=str(DEFAULT_MODEL_DIR),
        help="checkpoint (the tiny Llama created when missing) or pdserve/emulated (an emulated accelerator)",
    )
    p.add_argument("--load", type=float, default=1.0, help="scale every mix's arrival rate")
    p.add_argument("--output", default=str(RESULTS / "planner_validation.json"))
    p.add_argument(
        "--replay",
        metavar="RESULT",
        help="predict a stored run's measurements again with this simulator (seconds, no deployment)",
    )
    args = p.parse_args()
    result = replay_stored(json.loads(Path(args.replay).read_text())) if args.replay else run(args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for key, title in (("engine_only", "the engine profile alone"), ("served", "with the served path")):
        print(f"\n==== measured vs predicted by {title} (ms, req/s; error = predicted / measured - 1) ====")
        for row in result["rows"]:
            print(_line(row, key))
            if key == "served" and "hops_ms_p50" in row:
                print(_hops_line(row))
        errs = [abs(e) for r in result["rows"] for e in r[key]["error"].values()]
        within = sum(e <= 0.15 for e in errs)
        print(f"{within}/{len(errs)} within 15%, worst {max(errs):.0%}")
    for name, check in result.get("busy_probes", {}).items():
        print(_busy_line(name, check))
    print(f"wrote {out}")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
