"""``pdserve profile --served``: what a running deployment adds to its engine's steps (issue 34).

The engine profile times prefill and decode steps; a user's request also crosses the HTTP front
end, the router, the gRPC hops to the workers, and streams each token back the same way. Measured
here on the deployment itself, one load level at a time so nothing queues:

- **Before the first token**: single requests of several prompt lengths, one at a time, each sent
  twice (the second time its whole blocks are cached: long, yet little to compute); the client's
  TTFT minus the profile's prefill time for that prompt, fitted as ``ttft_s + per_token_s * prompt
  + prefill_scale * prefill`` (non-negative least squares): a fixed delay, the front end's work per
  prompt token, and a served prompt computed slower than the engine alone computes it (on a CPU host
  the front end's processes take cycles from the worker's threads).
- **Per decode step**: ``batch`` requests sent together (same length, so they decode in one batch);
  the median gap between streamed chunks minus the profile's decode step at that batch and context,
  fitted as ``step_s + step_per_seq_s * batch`` (non-negative least squares).

- **Beside other work** (``busy_streams``, off unless asked: ``bench.planner_validation`` asks): the
  TTFT phase's prompts once more, one after another, while a few long requests decode (``busy``
  samples, each with when it was sent). ``planner.busy_probes`` replays that scenario: a check of
  the simulator's shared-core model.

- **The host's CPU** (``host_usage``, a deployment on this machine: ``planner.host_cpu``): the front
  end's CPU seconds over the TTFT phase (2 tokens per request) and the ITL phase (dozens), solved for
  CPU per request and per streamed token; and the engine processes' CPU seconds over the time the
  profile says their steps took in the TTFT phase (``engine_cores``: a busy engine process keeps its
  torch threads and its own gRPC, IPC and transfer threads busy).

Prompts are random token ids (nothing cached between samples); every request is greedy with
``ignore_eos``, so its length is the one asked for.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import numpy as np

from planner import host_cpu
from planner.costs import ModelProfile, ServedOverhead

Progress = Callable[[str], None]


class ServedError(ConnectionError):
    """The deployment could not be measured (unreachable, refused a request, streamed nothing)."""


class Client:
    """Streams completions from an OpenAI-compatible endpoint; the arrival time of every chunk."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ServedError(
                f"--served wants the deployment's base URL (http://host:port), got {base_url!r}"
            )
        self.u, self.headers = u, {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.model = self._models()[0]
        self.requests = self.chunks = 0  # streamed so far (the CPU phases' counts)
        self._count = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.u.scheme == "https" else http.client.HTTPConnection
        return cls(self.u.hostname, self.u.port, timeout=300)

    def _models(self) -> list[str]:
        conn = self._conn()
        try:
            conn.request("GET", "/v1/models", headers=self.headers)
            resp = conn.getresponse()
            body = resp.read()
        except OSError as exc:
            raise ServedError(f"cannot reach {self.u.geturl()}: {exc}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise ServedError(f"GET /v1/models answered HTTP {resp.status}: {body[:200]!r}")
        return [m["id"] for m in json.loads(body)["data"]]

    def stream(
        self, prompt: list[int], max_tokens: int, first: threading.Event | None = None
    ) -> tuple[float, list[float]]:
        """(send time, chunk arrival times), perf_counter seconds; ``first`` is set at the first chunk."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        conn = self._conn()
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise ServedError(f"POST /v1/completions answered HTTP {resp.status}: {resp.read()[:300]!r}")
            times = []
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ServedError(f"the stream failed: {event['error']}")
                if any(c.get("text") for c in event.get("choices", [])):
                    times.append(time.perf_counter())
                    if first is not None:
                        first.set()
        finally:
            conn.close()
        if not times:
            raise ServedError("a request streamed no text")
        with self._count:
            self.requests += 1
            self.chunks += len(times)
        return t0, times


def measure_served(
    client: Client,
    profile: ModelProfile,
    prompt_lengths: tuple[int, ...] = (32, 128, 256),
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    output_tokens: int = 24,
    repeats: int = 3,
    progress: Progress = print,
    host_usage: Callable[[], dict] | None = None,
    busy_streams: int = 0,
) -> ServedOverhead:
    """``host_usage``: ``planner.host_cpu.usage`` where the deployment runs on this machine. Read
    around the TTFT and ITL phases, it adds the front end's CPU per request and per streamed token,
    and the cores a busy engine process keeps busy: what the simulator takes from shared cores.
    ``busy_streams`` (0: none): the TTFT probes again while that many long requests decode."""
    rng = random.Random(0)
    vocab = profile.model.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 10:
        raise ServedError(
            "the profile names no model.vocab_size to draw prompts from: run pdserve profile again"
        )

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    client.stream(prompt(16), 4)  # warm-up: connections, compiled paths
    samples: list[dict] = []
    bs = profile.model["block_size"]
    phase = _CPUPhase(client, host_usage)
    for n in prompt_lengths:
        fresh, again = [], []
        cached = (n - 1) // bs * bs
        # Each request: its prefill (fresh, then cached) and its second token's decode step.
        phase.busy += repeats * (
            profile.prefill_s(n) + profile.prefill_s(n - cached, cached) + 2 * profile.decode_step_s(1, n)
        )
        for _ in range(repeats):
            p = prompt(n)
            t0, times = client.stream(p, 2)
            fresh.append(times[0] - t0)
            t0, times = client.stream(p, 2)  # its whole blocks are cached now
            again.append(times[0] - t0)
        for runs, hit in ((fresh, 0), (again, cached)):
            ttft, engine = statistics.median(runs), profile.prefill_s(n - hit, hit)
            samples.append({"kind": "ttft", "prompt": n, "cached": hit, "seconds": ttft, "engine_s": engine})
            progress(
                f"TTFT of a {n}-token prompt alone, {hit} cached: {ttft * 1e3:.1f} ms "
                f"(engine {engine * 1e3:.1f})"
            )
    phase.end("ttft", samples, progress)
    n = prompt_lengths[0]
    for b in batches:
        gaps: list[float] = []
        for _ in range(repeats):
            gaps += _batch_gaps(client, [prompt(n) for _ in range(b)], output_tokens)
        itl = statistics.median(gaps)
        engine = profile.decode_step_s(b, n + output_tokens / 2)
        phase.busy += repeats * (b * profile.prefill_s(n) + (output_tokens - 1) * engine)
        samples.append({"kind": "itl", "batch": b, "prompt": n, "seconds": itl, "engine_s": engine})
        progress(f"ITL at a batch of {b}: {itl * 1e3:.2f} ms (engine step {engine * 1e3:.2f})")
    phase.end("itl", samples, progress)
    if busy_streams > 0:
        samples += _busy_ttfts(client, prompt, profile, prompt_lengths, busy_streams, repeats, progress)
    return fit_overhead(samples)


def _busy_ttfts(
    client: Client,
    prompt: Callable[[int], list[int]],
    profile: ModelProfile,
    lengths: tuple[int, ...],
    streams: int,
    repeats: int,
    progress: Progress,
) -> list[dict]:
    """The TTFT phase's prompts (each fresh, then cached) sent one after another while ``streams``
    long requests decode: a ``busy`` sample per probe, with when it was sent after the long ones (the
    simulator replays the same scenario: ``planner.busy_probes``)."""
    bs, first = profile.model["block_size"], lengths[0]
    cached = {n: (n - 1) // bs * bs for n in lengths}
    alone = sum(profile.prefill_s(n) + profile.prefill_s(n - cached[n], cached[n]) for n in lengths) * repeats
    step = profile.decode_step_s(streams + 1, first)
    room = int(profile.model.get("max_model_len") or 4096) - first - 1
    tokens = max(1, min(room, int(4 * (alone + 4 * len(lengths) * repeats * step) / step) + 64))
    background = [threading.Event() for _ in range(streams)]
    start = time.perf_counter()
    long_ones = _Threads([(client.stream, (prompt(first), tokens, e)) for e in background])
    deadline = time.monotonic() + 300
    while not all(e.is_set() for e in background):
        if long_ones.errors or time.monotonic() > deadline:
            long_ones.join()
            raise ServedError(f"the {streams} long requests did not start streaming: {long_ones.errors[:1]}")
        background[0].wait(0.05)
    out: list[dict] = []
    for n in lengths:
        for _ in range(repeats):
            p = prompt(n)
            for hit in (0, cached[n]):  # sent again: its whole blocks cached
                t0, times = client.stream(p, 2)
                out.append(
                    {"kind": "busy", "prompt": n, "cached": hit, "sent": t0 - start, "seconds": times[0] - t0}
                    | {"streams": streams, "stream_prompt": first, "stream_tokens": tokens}
                )
        for hit in (0, cached[n]):
            ttft = statistics.median(s["seconds"] for s in out if s["prompt"] == n and s["cached"] == hit)
            progress(
                f"TTFT of a {n}-token prompt, {hit} cached, beside {streams} decoding: {ttft * 1e3:.1f} ms"
            )
    long_ones.join()
    return out


class _Threads:
    """Calls on threads of their own, started at once; ``errors``: what they raised."""

    def __init__(self, calls: list[tuple[Callable, tuple]]) -> None:
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=c, daemon=True) for c in calls]
        for t in self.threads:
            t.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # re-raised by the caller, on its thread
            self.errors.append(exc)

    def join(self) -> None:
        for t in self.threads:
            t.join()


class _CPUPhase:
    """The host's CPU over a phase of requests: a ``cpu`` sample of the front end's seconds, its
    requests and streamed chunks (about one token each), the engine processes' seconds and how long
    the profile says their steps kept them busy (``busy``, added up by the caller)."""

    def __init__(self, client: Client, usage: Callable[[], dict] | None) -> None:
        self.client, self.read = client, usage
        self._start()

    def _start(self) -> None:
        self.at = (self.read() if self.read else None, self.client.requests, self.client.chunks)
        self.busy = 0.0

    def end(self, name: str, samples: list[dict], progress: Progress) -> None:
        if self.read is None:
            return
        spent = host_cpu.between(self.at[0], self.read())
        requests, chunks = self.client.requests - self.at[1], self.client.chunks - self.at[2]
        front, engines = spent["front"], sum(spent["engines"].values())
        samples.append(
            {
                "kind": "cpu",
                "phase": name,
                "requests": requests,
                "tokens": chunks,
                "seconds": front,
                "engine_seconds": engines,
                "engine_busy_s": self.busy,
            }
        )
        progress(
            f"CPU over the {name} phase: front end {front:.2f} s for {requests} requests, {chunks} tokens; "
            f"engine processes {engines:.2f} s over {self.busy:.2f} s of steps"
        )
        self._start()


def fit_warning(over: ServedOverhead) -> str | None:
    """What to tell the user when the fit cannot be right: every overhead at zero means the deployment
    served as fast as the engine profile says the engine alone computes, which no served path does
    (HTTP, tokenization, the hops): the engine profile's steps were timed too slow."""
    if over.ttft_s or over.per_token_s or over.prefill_scale or over.step_s or over.step_per_seq_s:
        return None
    return (
        "every served overhead fitted to zero: the engine profile's steps are as slow as or slower than "
        "the deployment's whole path, so it was likely measured while something else ran; profile the "
        "engine again on an idle machine, then --served"
    )


def fit_overhead(samples: list[dict]) -> ServedOverhead:
    """The overhead model from measured samples (see the module doc); never below zero."""
    ttft = [s for s in samples if s["kind"] == "ttft"]
    itl = [s for s in samples if s["kind"] == "itl"]
    if not ttft or not itl:
        raise ServedError("the served overhead needs TTFT and ITL samples")
    fixed, scale, per_token = _ttft_terms(ttft)
    batch = [float(s["batch"]) for s in itl]
    step, per_seq = _affine(batch, [s["seconds"] - s["engine_s"] for s in itl])
    cpu = [s for s in samples if s["kind"] == "cpu"]
    cpu_request, cpu_token = _cpu_terms(cpu)
    return ServedOverhead(
        fixed,
        step,
        per_seq,
        tuple(samples),
        prefill_scale=scale,
        per_token_s=per_token,
        cpu_per_request_s=cpu_request,
        cpu_per_token_s=cpu_token,
        engine_cores=_engine_cores(cpu),
    )


def _engine_cores(phases: list[dict]) -> float:
    """Cores a busy engine process keeps busy: its CPU seconds over the seconds its steps took by
    the profile (its torch threads, and its gRPC, IPC and transfer threads); 0 when not measured.
    From the TTFT phase: one request at a time, each step on one engine whatever the layout (the
    ITL phase's batches split over several decode workers, each step's base paid on each)."""
    phases = [p for p in phases if p.get("phase") == "ttft"]
    cpu = sum(p.get("engine_seconds", 0.0) for p in phases)
    busy = sum(p.get("engine_busy_s", 0.0) for p in phases)
    return cpu / busy if cpu > 0 and busy > 0 else 0.0


def _cpu_terms(phases: list[dict]) -> tuple[float, float]:
    """(CPU per request, per token) from phases of different tokens per request (the TTFT phase
    streams 2 each, the ITL phase dozens): ``seconds = requests * a + tokens * b``, both >= 0."""
    if not phases:
        return 0.0, 0.0
    x = np.array([[float(p["requests"]), float(p["tokens"])] for p in phases])
    y = np.array([max(float(p["seconds"]), 0.0) for p in phases])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if (coef >= 0).all() and len(phases) >= 2:
        return float(coef[0]), float(coef[1])
    return 0.0, float(y.sum() / max(x[:, 1].sum(), 1.0))  # one phase, or no split: all per token


def _ttft_terms(ttft: list[dict]) -> tuple[float, float, float]:
    """(fixed, prefill_scale, per prompt token): a prompt's served TTFT over its engine time as
    ``fixed + prefill_scale * engine_s + per_token * prompt``. A cached repeat of a prompt (long, yet
    little to compute) tells the front end's per-token cost from a slower prefill; without one (an
    older profile) the per-token term is left out."""
    extra = [s["seconds"] - s["engine_s"] for s in ttft]
    if not any(s.get("cached") for s in ttft):
        return (*_affine([s["engine_s"] for s in ttft], extra), 0.0)
    x = np.array([[1.0, s["engine_s"], float(s["prompt"])] for s in ttft])
    y = np.array(extra)
    keep = [0, 1, 2]
    while True:  # least squares in seconds; a term that comes out negative explains nothing: dropped
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0, 0.0, 0.0]
    for i, c in zip(keep, coef, strict=True):
        out[i] = max(float(c), 0.0)
    return out[0], out[1], out[2]


def _affine(x: list[float], extra: list[float]) -> tuple[float, float]:
    """``extra ~ a + b * x`` by least squares in seconds (not relative: an overhead can be ~0), both
    never below zero: a slope that comes out negative leaves the median as a constant, an intercept
    that does leaves all of it proportional to ``x``."""
    xs, ys = np.asarray(x), np.asarray(extra)
    constant = (max(float(np.median(ys)), 0.0), 0.0)
    if len(set(x)) < 2:
        return constant
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(xs), xs], axis=1), ys, rcond=None)
    if b < 0:  # grows with nothing: a constant
        return constant
    if a < 0:  # all of it proportional
        return 0.0, max(float(xs @ ys / (xs @ xs)), 0.0)
    return float(a), float(b)


def _batch_gaps(client: Client, prompts: list[list[int]], output_tokens: int) -> list[float]:
    """The gaps between chunks of ``len(prompts)`` requests sent together, after their first tokens
    (all prompts prefilled, the batch decoding)."""
    results: list[list[float]] = []
    calls = _Threads([(lambda p: results.append(client.stream(p, output_tokens)[1]), (p,)) for p in prompts])
    calls.join()
    if calls.errors:
        raise calls.errors[0]
    start = max(times[0] for times in results)  # every request has its first token: decoding together
    return [b - a for times in results for a, b in itertools.pairwise(times) if a >= start]
