"""A discrete-event simulator of a pdserve deployment: the router's real policy over simulated prefill
and decode workers whose step times come from a measured ``ModelProfile`` (issue 34).

What it models, as the real system does it:
- **Routing**: each arrival is routed by ``router.policies`` (the same ``choose`` the router runs) over
  ``WorkerRecord``s carrying the simulated loads, and a real ``PrefixIndex`` fed the simulated
  workers' KV events; a prompt whose part uncached on its decode worker is at most
  ``local_prefill_tokens`` is prefilled there (the router's local-prefill rule).
- **Prefill workers**: first come first served, prompts chunked into steps of at most
  ``max_num_batched_tokens`` new tokens; a step costs the profile's prefill curve over its chunks.
  The prompt's first token leaves when its last chunk is done (the TTFT), then its KV moves to the
  decode worker (the profile's transfer curve).
- **Decode workers**: continuous batching up to ``max_num_seqs`` sequences and the KV pool's blocks
  (a request waits for blocks rather than preempting); a step costs the profile's decode curve at
  the batch's size and mean context, plus the prefill chunks of prompts prefilled there.
- **Prefix caches**: each worker's whole prompt blocks, least recently used evicted first, as
  ``engine.block_pool`` keeps them; hits shorten prefills. A prompt's hit is read when its first
  chunk is scheduled, as the engine's scheduler reads it: one that arrived while another with its
  prefix was computing finds that prefix cached.

- **The served path** (when the profile has it for the deployment's mode: ``pdserve profile
  --served``): a fixed delay before routing (front end, router, hops), prompts computed slower than
  the engine alone computes them, and a per-step streaming cost.
- **Shared cores** (``host_cores``, a CPU deployment on one host): a step is stretched by the cores
  the busy workers' processes keep busy (``engine_cores`` as ``pdserve profile --served`` measured
  it, else their torch threads) plus the front end's CPU load (its CPU per request and per streamed
  token over the last 50 ms: it comes in bursts) over the cores, when they exceed them.

Not modelled: preemption, speculative decoding, KV tiers, a front end that saturates. Times are
seconds from the first arrival.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.block_hash import hash_blocks
from planner.costs import ModelProfile, ServedOverhead
from registry.prefix_index import PrefixIndex
from registry.schema import REMOVED, STORED, KVEventRecord, WorkerRecord
from router.policies import RoutingInput, make_policy

# The front end's CPU load on shared cores: its work over this much past. Short, because it comes in
# bursts: while a served prefill worker's thread waited for a core, everything but the engines kept
# 0.51 cores busy against 0.15 on average (bench/README.md, runs of 2026-12-06); 50 ms scored one
# more metric within 15% than 1 s on each of three stored validation runs.
FRONT_WINDOW_S = 0.05


@dataclass
class SimRequest:
    arrival: float
    prompt: list[int]
    output_len: int  # tokens generated, the first (from the prefill) included
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    # When it reached a worker, its last prompt step started, its KV landed on the decode worker and
    # its first decode step there started: the hops a served request's timing reports (``hop_medians``).
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def done(self) -> float | None:
        return self.token_times[-1] if len(self.token_times) == self.output_len else None


@dataclass(frozen=True)
class Deployment:
    prefill: int  # prefill replicas; 0: aggregated (decode workers prefill their own prompts)
    decode: int
    policy: str = "cache_aware"
    local_prefill_tokens: int = 0
    num_blocks: int | None = None  # per worker; default: the profile's engine
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # The workers share this many cores of one host (a CPU deployment): a step runs slower by the
    # busy workers' threads over the cores. None: each worker has its own device.
    host_cores: int | None = None

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(
                f"a deployment needs decode >= 1 and prefill >= 0, got {self.prefill}P+{self.decode}D"
            )
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError(f"host_cores must be at least 1, got {self.host_cores}")

    @property
    def mode(self) -> str:
        return "aggregated" if self.prefill == 0 else "disaggregated"


class _Cache:
    """A worker's prefix cache: block hash -> present, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def hit_blocks(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def store(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Insert ``hashes``; (stored, evicted)."""
        stored = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return stored, evicted


@dataclass
class _Seq:
    req: SimRequest
    hashes: list[bytes]
    todo: int  # prompt tokens still to compute here
    ctx: int  # prompt tokens already in the KV (cached or computed)
    decode: _Worker | None = None  # where it decodes (a prefill worker hands it there)
    generated: int = 0
    started: bool = False  # a chunk of it was scheduled (its prefix cache hit is then fixed)


class _Worker:
    def __init__(self, wid: str, role: str, sim: Simulator) -> None:
        self.wid, self.role, self.sim = wid, role, sim
        self.cache = _Cache(sim.num_blocks)
        self.waiting: deque[_Seq] = deque()  # to prefill (FIFO)
        self.joining: deque[_Seq] = deque()  # decode: prefilled elsewhere, KV here, waiting for room
        self.running: list[_Seq] = []  # decode: in the batch
        self.busy = False
        self.seq = 0  # KV event sequence number
        self.reserved = 0  # KV blocks of the batch's sequences, each at its final length
        self.queued = 0  # prompt tokens waiting to be computed here

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.wid,
            role=self.role,
            address="sim",
            epoch=1,
            block_size=self.sim.block_size,
            num_blocks=self.sim.num_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.joining),
            num_free_blocks=max(0, self.sim.num_blocks - self.reserved),
            queued_prompt_tokens=self.queued,
        )

    def publish(self, kind: str, hashes: list[bytes]) -> None:
        if hashes:
            self.seq += 1
            self.sim.index.apply(KVEventRecord(self.wid, 1, self.seq, kind, hashes))


class Simulator:
    def __init__(self, profile: ModelProfile, deployment: Deployment) -> None:
        self.profile, self.dep = profile, deployment
        eng = profile.engine
        self.block_size = profile.model["block_size"]
        self.num_blocks = deployment.num_blocks or eng["num_blocks"]
        self.budget = deployment.max_num_batched_tokens or eng["max_num_batched_tokens"]
        self.max_seqs = deployment.max_num_seqs or eng["max_num_seqs"]
        self.over = profile.served.get(deployment.mode, ServedOverhead())
        self.threads = max(1, int(profile.hardware.get("torch_threads", 1)))
        self.policy = make_policy(deployment.policy)
        self.policy.peer_reads = False  # no KV tiers here: a prompt's blocks are cached or computed
        self.index = PrefixIndex()
        self.prefills = [_Worker(f"prefill-{i}", "prefill", self) for i in range(deployment.prefill)]
        self.decodes = [_Worker(f"decode-{i}", "decode", self) for i in range(deployment.decode)]
        for w in self.prefills + self.decodes:
            self.index.replace(w.wid, epoch=1, seq=0, hashes=[])  # registered, nothing cached yet
        self._by_id = {w.wid: w for w in self.prefills + self.decodes}
        self._events: list = []
        self._front: deque[tuple[float, float, _Worker]] = deque()  # (when, CPU s, whose) front-end work
        self._tie = itertools.count()
        self.now = 0.0

    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._tie), fn, args))

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        for r in requests:  # the front end and the router's hops come before any worker sees it
            self._at(r.arrival + self.over.intake_s(len(r.prompt)), self._arrive, r)
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return requests

    # Arrival and routing ---------------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        whole = (
            (len(req.prompt) - 1) // self.block_size * self.block_size
        )  # the last token is always computed
        hashes = hash_blocks(req.prompt[:whole], self.block_size)
        inp = RoutingInput(
            iter(hashes),
            len(req.prompt),
            self.block_size,
            [w.record() for w in self.prefills],
            [w.record() for w in self.decodes],
        )
        route = self.policy.choose(inp, self.index)
        decode = self._worker(route.decode.worker_id)
        local = route.prefill is None or self._prefills_locally(req, hashes, decode)
        target = decode if local else self._worker(route.prefill.worker_id)
        hit = target.cache.hit_blocks(hashes) * self.block_size
        req.cached_tokens = hit
        seq = _Seq(req, hashes, todo=len(req.prompt) - hit, ctx=hit, decode=decode)
        req.marks["routed"] = self.now
        target.waiting.append(seq)
        target.queued += seq.todo
        self._front_work(self.over.request_cpu_s(len(req.prompt)), target)
        self._kick(target)

    def _prefills_locally(self, req: SimRequest, hashes: list[bytes], decode: _Worker) -> bool:
        limit = self.dep.local_prefill_tokens
        if limit <= 0:
            return False
        cached = decode.cache.hit_blocks(hashes) * self.block_size
        return len(req.prompt) - cached <= limit

    def _worker(self, wid: str) -> _Worker:
        return self._by_id[wid]

    # Steps -----------------------------------------------------------------------------------------

    def _kick(self, w: _Worker) -> None:
        if not w.busy:
            self._step(w)

    def _chunks(self, w: _Worker, budget: int) -> list[tuple[_Seq, int]]:
        """Prompt chunks of this step, first come first served, within the token budget."""
        out = []
        for s in w.waiting:
            if budget <= 0:
                break
            if not s.started:  # as the engine's scheduler, the prefix cache is read when it is taken
                s.started = True
                self._take_hit(w, s)
            n = min(s.todo, budget)
            out.append((s, n))
            budget -= n
        return out

    def _take_hit(self, w: _Worker, s: _Seq) -> None:
        """``s``'s prompt blocks cached on ``w`` now, when its first chunk is scheduled: a prompt
        that arrived while another with its prefix was being computed finds that prefix cached, and
        one whose prefix was evicted since its arrival computes it."""
        hit = min(w.cache.hit_blocks(s.hashes) * self.block_size, len(s.req.prompt) - 1)
        more = hit - s.ctx  # negative: blocks it found at arrival were evicted meanwhile
        if more:
            s.todo -= more
            s.ctx = hit
            w.queued -= more
            s.req.cached_tokens = hit

    def _step(self, w: _Worker) -> None:
        if w.role == "decode":
            self._admit(w)
        chunks = self._chunks(w, self.budget - len(w.running))
        if not chunks and not w.running:
            w.busy = False
            return
        p = self.profile.prefill
        cost = 0.0
        if chunks:
            work = sum(p.coef[1] * n + p.coef[2] * n * (s.ctx + n / 2) for s, n in chunks)
            cost += (p.coef[0] + work) * (1.0 + self.over.prefill_scale)
        if w.running:
            ctx = statistics.fmean(s.ctx + s.generated for s in w.running)
            cost += self.profile.decode_step_s(len(w.running), ctx) - (p.coef[0] if chunks else 0.0)
            cost += self.over.step_s + self.over.step_per_seq_s * len(w.running)
        w.busy = True
        for s, n in chunks:
            if n == s.todo:
                s.req.marks["prompt_step"] = self.now
        self._at(self.now + max(cost * self._sharing(w), 1e-9), self._step_done, w, chunks, list(w.running))

    def _sharing(self, w: _Worker) -> float:
        """How much slower a step starting now runs on cores the busy workers and the front end share
        (1: not shared)."""
        if self.dep.host_cores is None:
            return 1.0
        busy = sum(other.busy for other in self._by_id.values())  # the one starting this step included
        cores = self.over.engine_cores or self.threads  # what a busy worker's process keeps busy
        return max(1.0, (busy * cores + self._front_load(w)) / self.dep.host_cores)

    def _front_work(self, cpu_s: float, source: _Worker) -> None:
        """The front end (ingress, router, the workers' gRPC sides) spent ``cpu_s`` now on a request
        of ``source`` (taking it in, streaming its tokens)."""
        if self.dep.host_cores is not None and cpu_s > 0:
            self._front.append((self.now, cpu_s, source))

    def _front_load(self, stepping: _Worker) -> float:
        """Cores the front end kept busy over the last ``FRONT_WINDOW_S``. A worker whose threads
        fill the cores had its own requests' front-end work on its critical path when the served
        path was measured (``prefill_scale``, ``step_per_seq_s``): that part is not counted again."""
        while self._front and self._front[0][0] < self.now - FRONT_WINDOW_S:
            self._front.popleft()
        own_counted = self.threads < self.dep.host_cores
        return sum(c for _, c, whose in self._front if own_counted or whose is not stepping) / FRONT_WINDOW_S

    def _admit(self, w: _Worker) -> None:
        """Move prefilled sequences (KV arrived) and local prompts into the batch while blocks last;
        each holds its final length's blocks from admission on (no preemption later)."""
        while w.joining and len(w.running) < self.max_seqs:
            s = w.joining[0]
            need = self._blocks(s)
            if w.reserved + need > self.num_blocks and w.running:
                break
            w.reserved += need
            s.req.marks["decode_step"] = self.now  # its first decode step starts now (``_step``)
            w.running.append(w.joining.popleft())

    def _blocks(self, s: _Seq) -> int:
        return -(-(len(s.req.prompt) + s.req.output_len) // self.block_size)

    def _step_done(self, w: _Worker, chunks: list[tuple[_Seq, int]], batch: list[_Seq]) -> None:
        for s in batch:  # one token each
            s.generated += 1
            s.req.token_times.append(self.now)
        self._front_work(self.over.token_cpu_s() * len(batch), w)
        finished = [s for s in w.running if s.generated >= s.req.output_len]
        if finished:
            w.reserved -= sum(self._blocks(s) for s in finished)
            w.running = [s for s in w.running if s.generated < s.req.output_len]
        for s, n in chunks:
            s.todo -= n
            s.ctx += n
            w.queued -= n
            if s.todo == 0:
                w.waiting.remove(s)
                self._prefilled(w, s)
        self._step(w)

    def _prefilled(self, w: _Worker, s: _Seq) -> None:
        stored, evicted = w.cache.store(s.hashes)
        w.publish(STORED, stored)
        w.publish(REMOVED, evicted)
        s.req.first_token = self.now
        s.req.token_times.append(self.now)
        s.generated = 1
        self._front_work(self.over.token_cpu_s(), w)
        if s.req.output_len <= 1:
            return
        decode = s.decode
        if w is decode:  # prefilled where it decodes
            decode.joining.append(s)
            self._kick(decode)
            return
        hit = decode.cache.hit_blocks(s.hashes) * self.block_size
        moved = max(len(s.req.prompt) - hit, 0)
        self._at(self.now + self.profile.transfer_s(moved), self._arrived_kv, decode, s)

    def _arrived_kv(self, decode: _Worker, s: _Seq) -> None:
        s.req.marks["kv_landed"] = self.now
        stored, evicted = decode.cache.store(s.hashes)
        decode.publish(STORED, stored)
        decode.publish(REMOVED, evicted)
        decode.joining.append(s)
        self._kick(decode)


@dataclass(frozen=True)
class Summary:
    requests: int
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p90: float
    throughput: float  # requests per second, first arrival to last token
    goodput: float  # requests per second meeting both SLOs (when given), first arrival to last token
    good: int = 0  # requests meeting both SLOs

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def hop_medians(requests: list[SimRequest], disaggregated: bool) -> dict[str, float]:
    """Median ms per hop, named as a served request's timing names them (``x-pdserve-debug: timing``):
    where the simulator says the time before a first token went."""
    m = [(r, r.marks) for r in requests if r.first_token is not None and "prompt_step" in r.marks]
    hops = {"ttft": [r.first_token - r.arrival for r, _ in m]}
    queue, compute = (
        ("prefill_queue", "prefill_compute") if disaggregated else ("decode_queue", "decode_first_step")
    )
    hops[queue] = [k["prompt_step"] - k["routed"] for _, k in m]
    hops[compute] = [r.first_token - k["prompt_step"] for r, k in m]
    if disaggregated:
        # A decode worker's queue: its first step's start less the KV read (``worker.request_clock``).
        landed = [(r, k) for r, k in m if "kv_landed" in k]
        hops["kv_transfer"] = [k["kv_landed"] - r.first_token for r, k in landed]
        hops["decode_queue"] = [k["decode_step"] - k["kv_landed"] for _, k in landed if "decode_step" in k]
    return {name: statistics.median(v) * 1e3 for name, v in hops.items() if v}


def summarize(
    requests: list[SimRequest], ttft_slo: float | None = None, itl_slo: float | None = None
) -> Summary:
    ttft = [r.first_token - r.arrival for r in requests]
    gaps = [b - a for r in requests for a, b in itertools.pairwise(r.token_times)]
    span = max(r.done for r in requests) - min(r.arrival for r in requests)
    good = 0
    for r in requests:
        itl = statistics.median([b - a for a, b in itertools.pairwise(r.token_times)] or [0.0])
        if (ttft_slo is None or r.first_token - r.arrival <= ttft_slo) and (
            itl_slo is None or itl <= itl_slo
        ):
            good += 1
    return Summary(
        requests=len(requests),
        ttft_p50=_pct(ttft, 0.5),
        ttft_p90=_pct(ttft, 0.9),
        itl_p50=_pct(gaps, 0.5),
        itl_p90=_pct(gaps, 0.9),
        throughput=len(requests) / span if span > 0 else 0.0,
        goodput=good / span if span > 0 else 0.0,
        good=good,
    )
