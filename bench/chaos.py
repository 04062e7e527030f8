"""Chaos: streaming requests over HTTP while workers are killed and stalled and Redis restarts.

    python -m bench.chaos [--requests 160] [--concurrency 8] [--prefill 2] [--decode 2]
                          [--faults kill_decode,stop_decode,kill_prefill,stop_prefill,restart_redis]
                          [--stall-s 20] [--cancel-rate 0.2] [--num-blocks N] [--soak-s S]
                          [--quick] [--json PATH]

One ``pdserve serve`` (disaggregated, a real ``redis-server``) started by this script in its own
session, so the only processes it ever signals are that service's own replicas. A closed-loop
client streams greedy completions (``ignore_eos``) of a few fixed prompts while an injector works
through the fault list, one fault at a time:

- ``kill_decode`` / ``kill_prefill``: SIGKILL the replica of that deployment with the most requests
  (``pdserve status``), so the fault catches streams;
- ``stop_decode`` / ``stop_prefill``: SIGSTOP that replica for ``--stall-s`` seconds, then SIGCONT;
- ``restart_redis``: SIGKILL the redis-server and start it again, empty.

The load runs ``--requests`` requests at least, and on until every fault has struck (mid-stream)
and the service is back at full strength after it.

Every request ends as one of: identical (its text equals the engine alone's), wrong (completed with
other text), error (an OpenAI-style error with a message, in the HTTP status or in the stream),
unclear error (an error without one), hung (still open after ``--deadline-s``) or cancelled (its
client gave up mid-stream: ``--cancel-rate``). Per fault: how
long clients went without a token (the client-visible stall: the longest gap between tokens, or
from a request's start to its first token, of the streams open when it struck or started after,
until the next fault), and how long until the service was back at full strength (every worker
registered again, all replica processes alive); and what the router did meanwhile (requests moved
to another decode worker, stalls it gave up on).
At the end, once idle, every worker's KV blocks must be free (``blocks_leaked`` counts the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.chaos_faults import (
    FAULTS,
    RedisProcess,
    inject,
    registered_workers,
    router_counters,
    wait_full_strength,
)

RESULTS = Path(__file__).parent / "results"


@dataclass
class Outcome:
    index: int
    prompt: int
    kind: str = "hung"  # identical | wrong | error | unclear_error | hung | cancelled
    detail: str = ""
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)


@dataclass
class Fault:
    kind: str
    victim: str
    at: float
    open_streams: list[int]
    capacity_restored_s: float | None = None
    longest_silence_s: float | None = None
    not_restored: str = ""  # the last state seen, when full strength did not come back in time
    router: dict[str, float] = field(default_factory=dict)  # its counters' rise (moved, stalls, refused)


async def stream_one(
    session, base, body, outcome: Outcome, reference: str, deadline_s: float, cancel_after: int | None = None
) -> None:
    """Stream one completion into ``outcome``; ``cancel_after``: close the connection after that many
    chunks, as a client that gives up does."""

    async def run() -> None:
        parts: list[str] = []
        async with session.post(base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                err = json.loads(text).get("error", {}) if text.startswith("{") else {}
                outcome.kind = "error" if err.get("message") else "unclear_error"
                outcome.detail = f"HTTP {resp.status}: {err.get('message') or text[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    msg = event["error"].get("message")
                    outcome.kind, outcome.detail = ("error" if msg else "unclear_error"), str(msg or event)
                    return
                outcome.token_times.append(time.monotonic())
                parts.append(event["choices"][0]["text"])
                if cancel_after is not None and len(parts) >= cancel_after:
                    outcome.kind = "cancelled"  # leaving the block closes the connection
                    return
        outcome.kind = "identical" if "".join(parts) == reference else "wrong"

    import aiohttp

    outcome.start = time.monotonic()
    try:
        await asyncio.wait_for(run(), deadline_s)
    except asyncio.TimeoutError:
        outcome.kind = "hung"
    except aiohttp.ClientError as exc:  # the connection itself failed: an answer, but not a clear one
        outcome.kind, outcome.detail = "unclear_error", f"{type(exc).__name__}: {exc}"
    outcome.end = time.monotonic()


async def run_chaos(
    base: str,
    session_id: int,
    redis: RedisProcess,
    prompts: list[list[int]],
    references: list[str],
    *,
    requests: int,
    concurrency: int,
    max_tokens: int,
    faults: list[str],
    expect: dict[str, int],
    stall_s: float,
    deadline_s: float,
    headers: dict[str, str] | None = None,
    seed: int = 0,
    cancel_rate: float = 0.0,
    soak_s: float = 0.0,
) -> dict:
    """Run the load and the faults against the service at ``base`` (session ``session_id``); the
    summary. ``cancel_rate``: the share of requests their client abandons mid-stream; ``soak_s``:
    go through the fault list again and again until that long has passed (at least once)."""
    import aiohttp
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    open_now: set[int] = set()
    faults_done = asyncio.Event()
    records: list[Fault] = []
    bar = tqdm(total=requests, desc="chaos", unit="req")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(headers=headers or {}, timeout=timeout) as http:
        async with http.get(base + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]

        async def client() -> None:
            # At least ``requests``, and on until every fault has struck and been recovered from.
            while len(outcomes) < requests or not faults_done.is_set():
                o = Outcome(len(outcomes), len(outcomes) % len(prompts))
                outcomes.append(o)
                body = {
                    "model": model,
                    "prompt": prompts[o.prompt],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                open_now.add(o.index)
                cancel = rng.randint(1, 8) if rng.random() < cancel_rate else None
                await stream_one(http, base, body, o, references[o.prompt], deadline_s, cancel)
                open_now.discard(o.index)
                bar.update(1)

        async def injector() -> None:
            # Faults start once streams run; each waits for the service to be whole again first.
            t_end = time.monotonic() + soak_s
            cycle = itertools.chain(
                faults, itertools.takewhile(lambda _: time.monotonic() < t_end, itertools.cycle(faults))
            )
            try:
                for kind in cycle:
                    await wait_full_strength(http, base, session_id, expect, 180)
                    while not any(outcomes[i].token_times for i in open_now):
                        await asyncio.sleep(0.05)  # strike mid-stream
                    rec = Fault(kind, "", time.monotonic(), [])
                    before = await router_counters(http, base)

                    def strike(rec: Fault = rec) -> None:
                        rec.at, rec.open_streams = time.monotonic(), sorted(open_now)

                    rec.victim = await inject(kind, base, session_id, redis, stall_s, rng, strike)
                    bar.write(f"  fault: {kind} ({rec.victim})")
                    records.append(rec)
                    restored, rec.not_restored = await wait_full_strength(http, base, session_id, expect, 180)
                    if restored:
                        rec.capacity_restored_s = time.monotonic() - rec.at
                    after = await router_counters(http, base)
                    rec.router = {k: after[k] - before[k] for k in before}
            finally:
                faults_done.set()

        clients = [asyncio.create_task(client()) for _ in range(concurrency)]
        chaos = asyncio.create_task(injector())
        await asyncio.gather(*clients, chaos)
        bar.close()
        leaked, idle = await _blocks_after_idle(http, base, timeout_s=60)
    for rec, nxt in zip(records, [*records[1:], None]):
        rec.longest_silence_s = _resumed(rec, outcomes, nxt.at if nxt else float("inf"))
    return _summary(outcomes, records, leaked, idle)


async def _blocks_after_idle(http, base, timeout_s: float) -> tuple[int, bool]:
    """(KV blocks not free, whether every worker went idle) once the service is quiet."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = await registered_workers(http, base)
        busy = any(w.get("running", 0) or w.get("waiting", 0) for w in workers.values())
        leaked = int(sum(w.get("total", 0) - w.get("free", 0) for w in workers.values()))
        if (not busy and leaked == 0) or time.monotonic() > deadline:
            return leaked, not busy
        await asyncio.sleep(0.25)


def _resumed(rec: Fault, outcomes: list[Outcome], until: float) -> float | None:
    """The longest silence a client saw from the fault until ``until`` (the next fault): over the
    streams open when it struck (from the fault on) and those started meanwhile (from their start:
    a request routed to a stalled worker waits too), the longest wait for a next token or the end."""
    open_then = set(rec.open_streams)
    worst = None
    for o in outcomes:
        if o.index in open_then:
            begin = rec.at
        elif rec.at <= o.start < until:
            begin = o.start
        else:
            continue
        marks = [begin, *(t for t in o.token_times if begin < t < until)]
        if o.end < until:
            marks.append(o.end)
        gap = max((b - a for a, b in itertools.pairwise(marks)), default=None)
        if gap is not None:
            worst = gap if worst is None else max(worst, gap)
    return worst


def _summary(outcomes: list[Outcome], records: list[Fault], leaked: int, idle: bool) -> dict:
    kinds = ("identical", "wrong", "error", "unclear_error", "hung", "cancelled")
    counts = {k: sum(o.kind == k for o in outcomes) for k in kinds}
    t0 = min((o.start for o in outcomes if o.start), default=0.0)
    return {
        "requests": len(outcomes),
        **counts,
        "blocks_leaked": leaked,
        "idle_at_end": idle,
        "errors": sorted({o.detail for o in outcomes if o.kind in ("error", "unclear_error")})[:20],
        "faults": [asdict(r) | {"at": round(r.at - t0, 3)} for r in records],
        "timeline": [(o.start, o.end, o.kind, o.token_times) for o in outcomes],
        "t0": t0,
        "fault_times": [(r.kind, r.at) for r in records],
    }


def print_table(res: dict) -> None:
    print(f"\nrequests sent {res['requests']}: identical {res['identical']}, wrong {res['wrong']}, "
          f"clear error {res['error']}, unclear error {res['unclear_error']}, hung {res['hung']}, "
          f"cancelled by their clients {res['cancelled']}; "
          f"KV blocks leaked {res['blocks_leaked']}")  # fmt: skip
    cols = ("open streams", "moved", "stalls", "longest silence (s)", "capacity back (s)")
    print(f"{'fault':15s} {'victim':18s} " + " ".join(f"{c:>{max(7, len(c))}s}" for c in cols))
    for f in res["faults"]:
        r = f["router"]
        cells = (
            len(f["open_streams"]),
            int(r.get("moved", 0)),
            int(r.get("stalls", 0)),
            "-" if f["longest_silence_s"] is None else f"{f['longest_silence_s']:.1f}",
            "-" if f["capacity_restored_s"] is None else f"{f['capacity_restored_s']:.1f}",
        )
        print(
            f"{f['kind']:15s} {f['victim']:18s} "
            + " ".join(f"{v!s:>{max(7, len(c))}s}" for c, v in zip(cols, cells))
        )
    for f in res["faults"]:
        if f["not_restored"]:
            print(f"  after {f['kind']}, not back at full strength: {f['not_restored'][:300]}")
    for e in res["errors"]:
        print("  error:", e[:160])


def plot(res: dict, path: Path) -> None:
    """Tokens per second over time with the faults marked: what the client saw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = res["t0"]
    times = sorted(t - t0 for _, _, _, tt in res["timeline"] for t in tt)
    if not times:
        return
    width = 1.0
    bins = [0] * (int(times[-1] / width) + 1)
    for t in times:
        bins[int(t / width)] += 1
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot([i * width for i in range(len(bins))], [b / width for b in bins], lw=1)
    for kind, at in res["fault_times"]:
        ax.axvline(at - t0, color="r", ls="--", lw=0.8)
        ax.text(at - t0, max(bins) / width, kind, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("streamed tokens/s")
    failed = res["error"] + res["unclear_error"] + res["wrong"]
    ax.set_title(
        f"chaos: {res['requests']} requests: {res['identical']} identical, {res['cancelled']} cancelled by "
        f"their clients, {failed} failed, {res['hung']} hung; {res['blocks_leaked']} KV blocks leaked"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stall-s", type=float, default=20.0)
    p.add_argument("--deadline-s", type=float, default=120.0, help="a request open longer has hung")
    p.add_argument("--cancel-rate", type=float, default=0.0, help="share of requests abandoned mid-stream")
    p.add_argument("--soak-s", type=float, default=0.0, help="repeat the fault list this long")
    p.add_argument("--num-blocks", type=int, help="KV blocks per worker (small: preemption under load)")
    p.add_argument("--quick", action="store_true", help="40 requests, one decode kill and one stall")
    p.add_argument("--json", default=str(RESULTS / "chaos.json"))
    a = p.parse_args()
    if a.quick:
        a.requests, a.faults = 40, "kill_decode,stop_decode"
    faults = [f for f in a.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")

    from bench.serving_harness import serving_process
    from cli.tiny_model import ensure_tiny_model
    from engine import LLM, SamplingParams

    model = ensure_tiny_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(a.prompt_len)] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    references = [o.outputs[0].text for o in LLM(str(model), num_blocks=512).generate(prompts, params)]
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess(Path(tmp))
        flags = ("--prefill", str(a.prefill), "--decode", str(a.decode), "--redis-url", redis.url)
        flags += ("--num-blocks", str(a.num_blocks)) if a.num_blocks else ()
        try:
            with serving_process(*flags) as (base, proc):
                res = asyncio.run(
                    run_chaos(
                        base, proc.pid, redis, prompts, references,
                        requests=a.requests, concurrency=a.concurrency, max_tokens=a.max_tokens,
                        faults=faults, expect={"prefill": a.prefill, "decode": a.decode},
                        stall_s=a.stall_s, deadline_s=a.deadline_s, cancel_rate=a.cancel_rate, soak_s=a.soak_s,
                    )
                )  # fmt: skip
        finally:
            redis.kill()
    print_table(res)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: v for k, v in res.items() if k != "timeline"}, indent=1))
    print(f"wrote {out}")
    plot(res, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
