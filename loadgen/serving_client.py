"""``pdserve bench``: a load generator for any OpenAI-compatible server (pdserve or another).

Each request streams ``/v1/completions``; everything is measured here, at the client, from the
stream: TTFT (send -> first token), ITL (gaps between token chunks), TPOT ((E2E - TTFT) / (tokens -
1)), E2E latency, request and token throughput, and goodput (requests/s meeting ``--goodput``
SLOs). Load is closed-loop (``--max-concurrency`` clients back to back) or open-loop
(``--request-rate`` arrivals, Poisson or gamma with ``--burstiness``), after ``--warmup`` requests
that are not counted. ``--sweep 1,4,16`` repeats a closed-loop run per concurrency. No two of these
send the same prompt (``serving_datasets.RequestSets``): the warm-up's prompts are not measured
again, and each level of a sweep has prompts of its own, or every request after the first would
measure a prefix-cache hit. Results go to JSON, and PNG plots: latency CDFs, and throughput /
latency against concurrency for a sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from loadgen import flag_types
from loadgen.serving_datasets import DATASETS, RequestSets, ServingRequest
from loadgen.vllm_result import percentile, vllm_fields, write_results

DEFAULT_CONCURRENCY = 8  # a closed loop's clients without --max-concurrency


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    timing_ms: dict[str, float] = field(default_factory=dict)  # the server's hop timing (--debug-timing)
    usage_missing: bool = False  # the server sent no usage: token counts are chunk counts

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def send(
    session: aiohttp.ClientSession, url: str, model: str, req: ServingRequest, args, headers: dict
) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    chunks = 0
    usage = False
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = _stream_error(event["error"])
                    return res
                if "pdserve_timing" in event:
                    res.timing_ms = event["pdserve_timing"]
                if event.get("usage"):
                    usage = True
                    res.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                    res.output_tokens = event["usage"].get("completion_tokens", 0)
                if _carries_tokens(event.get("choices"), last is None):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    except (ValueError, TypeError, AttributeError) as exc:  # a malformed event fails this request only
        res.error = f"bad stream event: {type(exc).__name__}: {exc}"[:200]
        return res
    res.e2e_s = time.perf_counter() - t0
    if not usage:  # a server that ignores include_usage: token chunks counted, a token-id prompt's length
        res.usage_missing = True
        res.output_tokens = chunks
        res.prompt_tokens = len(req.prompt) if isinstance(req.prompt, list) else 0
    res.ok = last is not None
    if not res.ok:
        res.error = "no tokens in the stream"
    return res


def _carries_tokens(choices, first: bool) -> bool:
    """Whether a stream event brings tokens, as vLLM's client counts them: any choice, its text
    empty too (a special token, part of a character, text held back for a stop string); a choice
    with empty text and a finish_reason only ends the stream, unless no token came before it."""
    if not choices:
        return False
    return any(c.get("text") or c.get("finish_reason") is None or first for c in choices)


def _stream_error(error) -> str:
    """An error event's message: OpenAI's object, or a plain string (TGI's)."""
    if isinstance(error, dict):
        return str(error.get("message", "stream error"))
    return str(error)


def _arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from start): Poisson (burstiness 1) or gamma with shape = burstiness."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def server_root(base_url: str) -> str:
    """The server's root: the URL the serve banner prints (``.../v1``) names the same server."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") if root.endswith("/v1") else root


async def run_load(
    args,
    requests: list[ServingRequest],
    concurrency: int | None,
    rate: float | None,
    warmup: list[ServingRequest] | None = None,
) -> dict:
    """Send ``warmup`` (None: ``RequestSets(args).warmup()``, prompts no measured request shares),
    then measure ``requests``: closed loop at ``concurrency``, or open loop at ``rate``."""
    if warmup is None:
        warmup = RequestSets(args).warmup() if args.warmup else []
    url = server_root(args.base_url) + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if getattr(args, "debug_timing", False):
        headers["x-pdserve-debug"] = "timing"  # pdserve returns each request's hop timing
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    limit = concurrency or 0  # with a rate too: a cap on the requests in flight, as vLLM's
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit)) as session:
        model = args.model or await _first_model(session, args.base_url, headers)
        await asyncio.gather(*(send(session, url, model, r, args, headers) for r in warmup))
        bar = tqdm(total=len(requests), desc=_label(concurrency, rate), unit="req", disable=args.no_progress)
        results: list[RequestResult] = []

        cap = asyncio.Semaphore(concurrency) if rate and concurrency else None

        async def one(r: ServingRequest) -> None:
            if cap is None:
                results.append(await send(session, url, model, r, args, headers))
            else:
                async with cap:
                    results.append(await send(session, url, model, r, args, headers))
            bar.update(1)

        t0 = time.perf_counter()
        if rate:
            tasks = []
            for at, r in zip(_arrivals(len(requests), rate, args.burstiness, args.seed), requests):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                tasks.append(asyncio.create_task(one(r)))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(requests))

            async def client() -> None:
                while queue:
                    await one(queue.pop())

            await asyncio.gather(*(client() for _ in range(concurrency or 1)))
        elapsed = time.perf_counter() - t0
        bar.close()
    summary = summarize(results, elapsed, args.goodput, concurrency, rate)
    goodput = summary["goodput"] if args.goodput else None
    summary["vllm"] = vllm_fields(results, elapsed, goodput, concurrency, rate, args.burstiness) | {
        "model_id": model
    }
    return summary


async def _first_model(session, base_url: str, headers: dict) -> str:
    """The first model ``/v1/models`` lists; a server that cannot be reached is a ConnectionError and
    a refusal a ValueError, each one line that says what to do (``pdserve bench`` prints it)."""
    url = server_root(base_url) + "/v1/models"
    try:
        async with session.get(url, headers=headers) as resp:
            status, body = resp.status, await resp.read()
    except aiohttp.ClientConnectionError as exc:
        raise ConnectionError(f"cannot reach {url}: {exc}") from None
    if status == 401:
        raise ValueError(f"{url} answered 401: give the server's key (--api-key or PDSERVE_API_KEY)")
    if status != 200:
        raise ValueError(f"{url} answered {status}: is --base-url an OpenAI-compatible server's root?")
    try:
        return json.loads(body)["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise ValueError(f"{url} lists no model: give --model") from None


def _label(concurrency, rate) -> str:
    if rate:
        return f"rate {rate}/s" + (f", at most {concurrency} in flight" if concurrency else "")
    return f"concurrency {concurrency}"


def _stats(values: list[float]) -> dict[str, float]:
    """The same statistics as the vLLM-format fields (``loadgen.vllm_result``): one median per
    output file, whichever section a reader looks at."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def summarize(results: list[RequestResult], elapsed: float, goodput: dict, concurrency, rate) -> dict:
    ok = [r for r in results if r.ok]
    itl = [g for r in ok for g in r.itl_s]
    good = [r for r in ok if meets_slo(r, goodput)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "request_rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "usage_missing": sum(r.usage_missing for r in ok),
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        "goodput": len(good) / elapsed,
        "goodput_slo_ms": goodput,
        "ttft_s": _stats([r.ttft_s for r in ok]),
        "tpot_s": _stats([r.tpot_s for r in ok if r.output_tokens > 1]),
        "itl_s": _stats(itl),
        "e2e_s": _stats([r.e2e_s for r in ok]),
        "samples": {
            "ttft_s": [r.ttft_s for r in ok],
            "itl_s": itl,
            "e2e_s": [r.e2e_s for r in ok],
            "timing_ms": [r.timing_ms | {"client_ttft": r.ttft_s * 1e3} for r in ok if r.timing_ms],
        },
        "hop_timing_ms": hop_summary(ok),
    }


def meets_slo(r: RequestResult, goodput: dict[str, float]) -> bool:
    """Whether a completed request is within every ``--goodput`` SLO (milliseconds)."""
    measured_ms = {"ttft": r.ttft_s * 1000, "tpot": r.tpot_s * 1000, "e2e": r.e2e_s * 1000}
    return all(measured_ms[name] <= slo for name, slo in goodput.items())


def hop_summary(results: list[RequestResult]) -> dict[str, dict[str, float]]:
    """Per hop of the server's timing (--debug-timing), plus ``http_proxy``: the client's TTFT less
    the ingress's (the HTTP proxy, the network and the client's own parsing)."""
    by_hop: dict[str, list[float]] = {}
    for r in results:
        hops = dict(r.timing_ms)
        if "ttft" in hops:
            hops["http_proxy"] = max(0.0, r.ttft_s * 1e3 - hops["ttft"])
            hops["client_ttft"] = r.ttft_s * 1e3
        for name, ms in hops.items():
            by_hop.setdefault(name, []).append(ms)
    return {name: _stats(values) for name, values in by_hop.items()}


def print_report(s: dict) -> None:
    def ms(d):
        return f"mean {d['mean'] * 1e3:8.1f}  median {d['median'] * 1e3:8.1f}  p90 {d['p90'] * 1e3:8.1f}  p99 {d['p99'] * 1e3:8.1f} ms"

    print(
        f"\n== {_label(s['concurrency'], s['request_rate'])}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f}s"
    )
    for e in s["errors"]:
        print(f"   error: {e}")
    if s.get("usage_missing"):
        print(
            f"   note: {s['usage_missing']} responses carried no usage (the server ignores "
            "stream_options.include_usage): their output tokens are counted as stream chunks"
        )
    print(
        f"   requests/s {s['request_throughput']:.2f}   output tok/s {s['output_token_throughput']:.1f}   total tok/s {s['total_token_throughput']:.1f}"
    )
    if s["goodput_slo_ms"]:
        slo = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in s["goodput_slo_ms"].items())
        print(f"   goodput {s['goodput']:.2f} req/s within {slo}")
    if not s["completed"]:  # no latency to report: not zeros
        print("   no request completed: no latencies")
        return
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        print(f"   {name[:-2].upper():5s} {ms(s[name])}")
    for hop, st in s.get("hop_timing_ms", {}).items():
        print(f"   hop {hop:22s} median {st['median']:8.2f}  p90 {st['p90']:8.2f} ms")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url", required=True, type=flag_types.base_url, help="server root, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None, help="bearer key (or env PDSERVE_API_KEY)")
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset sharegpt")
    p.add_argument(
        "--tokenizer", default=None, help="count ShareGPT answer lengths in this tokenizer's tokens"
    )
    p.add_argument(
        "--num-prompts", type=flag_types.positive_int, default=100, help="measured requests (per level)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--num-prefixes", type=flag_types.positive_int, default=4)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--long-len", type=int, default=1024, help="interference: long prompt length")
    p.add_argument("--long-fraction", type=float, default=0.2, help="interference: share of long prompts")
    p.add_argument("--vocab-size", type=int, default=1000, help="token ids are drawn from [10, this)")
    p.add_argument(
        "--max-concurrency",
        type=flag_types.positive_int,
        default=None,
        help=f"closed loop: clients back to back (default {DEFAULT_CONCURRENCY}); with --request-rate: "
        "the most requests in flight (default: no cap)",
    )
    p.add_argument(
        "--request-rate",
        type=flag_types.request_rate,
        default=None,
        help="open loop: arrivals per second (> 0); left out, a closed loop of --max-concurrency clients",
    )
    p.add_argument(
        "--burstiness", type=flag_types.positive_float, default=1.0, help="gamma shape (> 0; 1 = Poisson)"
    )
    p.add_argument(
        "--sweep",
        type=flag_types.concurrency_levels,
        default=None,
        help="comma-separated concurrencies (each at least 1), a closed loop each; "
        "level i draws its own prompts, with --seed + i",
    )
    p.add_argument(
        "--warmup",
        type=flag_types.non_negative_int,
        default=2,
        help="requests sent first and not counted, with prompts of their own (none measured)",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--goodput",
        nargs="*",
        type=flag_types.goodput_slo,
        help="SLOs, e.g. ttft:500 tpot:50 e2e:2000 (milliseconds): goodput counts the requests within all",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument(
        "--seed",
        type=flag_types.non_negative_int,
        default=0,
        help="the prompts' seed (level i of a --sweep draws with seed + i, the warm-up with one of its own)",
    )
    p.add_argument(
        "--output-json", default=None, help="write the results here (vllm bench serve's field names)"
    )
    p.add_argument("--plot", default=None, help="write PNG plots with this path prefix")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--debug-timing",
        action="store_true",
        help="ask pdserve for each request's per-hop timing (x-pdserve-debug: timing) and summarise it",
    )


def run(args) -> dict:
    from settings import environment

    args.api_key = args.api_key or environment.api_key()
    args.goodput = dict(args.goodput or [])
    if args.sweep and (args.request_rate or args.max_concurrency):
        raise ValueError(
            "--sweep runs a closed loop at each of its concurrencies: leave out --request-rate and "
            "--max-concurrency"
        )
    sets = RequestSets(args)
    warmup = sets.warmup()
    if args.sweep:
        runs = [asyncio.run(run_load(args, sets.level(i), c, None, warmup)) for i, c in enumerate(args.sweep)]
    else:
        concurrency = args.max_concurrency or (None if args.request_rate else DEFAULT_CONCURRENCY)
        runs = [asyncio.run(run_load(args, sets.level(0), concurrency, args.request_rate, warmup))]
    for s in runs:
        print_report(s)
    result = {
        "base_url": args.base_url,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "runs": runs,
    }
    if args.output_json:
        for path in write_results(args.output_json, runs, result, args):
            print(f"\nwrote {path}")
    if args.plot:
        from loadgen.serving_plots import plot_runs

        for path in plot_runs(runs, args.plot):
            print(f"wrote {path}")
    return result
