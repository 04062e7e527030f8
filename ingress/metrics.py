"""Prometheus metrics under fixed names, so dashboards can rely on them.

Request-level series (TTFT, ITL, end-to-end latency, requests by status) are measured in the
ingress, where the client's view of the stream is. Worker-level series (running, waiting, KV usage,
prefix-cache hits, preemptions, KV transfer bytes / latency / failures) are read from every worker's
own GetState at scrape time and exported labelled by role and worker, so they are never stale and
no worker needs an HTTP port. The router's predicted and delivered prefix-hit ratios ride along.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ingress.request_timing import TOTALS
from ingress.router_metrics import router_families
from proto import pdserve_pb2 as pb

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Hops run from microseconds (a socket write) to a queue's wait, which TTFT's buckets bound at 120 s.
HOP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
    30.0,
    120.0,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
STATUSES = ("success", "client_error", "rejected", "cancelled", "error")


class IngressMetrics:
    """One ingress replica's request-level metrics (its own registry: no process-global state).

    Every series carries ``frontend``, the replica's id: front ends that share a port
    (``--frontends N``) each answer some of the scrapes, and a counter without it would jump between
    their values (read as resets: ``rate()`` explodes). With it, each front end's series stays
    monotonic and ``sum by (...)`` adds them up."""

    def __init__(self, model: str, frontend: str = "0") -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.key = (model, frontend)  # the label values of every request-level series
        labels = ["model_name", "frontend"]
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival at the ingress to the first generated token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = TokenHistogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            labels,
            ITL_BUCKETS,
            self.registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request arrival to its last token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.hops = Histogram(
            "pdserve_hop_seconds",
            "Time a request spent in each hop (ingress, router, prefill queue/compute, KV transfer, "
            "first decode step, ...), as each hop measured it",
            [*labels, "hop"],
            buckets=HOP_BUCKETS,
            registry=self.registry,
        )
        self._hop_children: dict[str, object] = {}
        self._itl = self.itl.labels(*self.key)  # per token: the labelled child looked up once
        self._ttft, self._e2e = self.ttft.labels(*self.key), self.e2e.labels(*self.key)
        self.requests = Counter(
            "pdserve_requests", "Finished requests by status", [*labels, "status"], registry=self.registry
        )
        for status in STATUSES:
            self.requests.labels(*self.key, status)
        # vLLM's prompt_tokens_total / generation_tokens_total, counted once per request sent to
        # the router, when it ends (finished, failed or cancelled: the tokens were computed).
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens",
            "Prompt tokens of requests sent to the router",
            labels,
            registry=self.registry,
        ).labels(*self.key)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens",
            "Tokens generated for requests (every sample)",
            labels,
            registry=self.registry,
        ).labels(*self.key)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def observe_token_gap(self, gap_s: float, tokens: int) -> None:
        """``tokens`` tokens that arrived together ``gap_s`` after the last: each an ITL sample of
        ``gap_s / tokens``."""
        if tokens:
            self._itl.observe_n(gap_s / tokens, tokens)

    def observe_hops(self, hops: dict[str, float]) -> None:
        """One request's hop timing (milliseconds), totals (TTFT, E2E) left out."""
        children = self._hop_children
        for hop, ms in hops.items():
            if hop in TOTALS:
                continue
            child = children.get(hop)
            if child is None:
                child = children[hop] = self.hops.labels(*self.key, hop)
            child.observe(ms / 1e3)

    def count_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def count(self, status: str) -> None:
        self.requests.labels(*self.key, status).inc()

    def render(
        self, cluster: pb.ClusterState | None, workers: list[pb.WorkerState], ingress: tuple[str, int, int]
    ) -> bytes:
        """``ingress``: (this replica's id, requests it is streaming, requests waiting for a slot)."""
        snapshot = CollectorRegistry()
        snapshot.register(_ClusterCollector(cluster, workers, ingress))
        return generate_latest(self.registry) + generate_latest(snapshot)


class TokenHistogram:
    """A labelled Prometheus histogram for per-token samples, exported like ``Histogram`` (``_bucket``,
    ``_count``, ``_sum``). Its children are plain counters, and ``observe_n`` records n equal samples
    with one bucket search: ``Histogram.observe`` takes a lock per bucket and per sum, and its
    per-token calls were 12% of the ingress's CPU on short streams. The ingress's event loop is the
    only writer; a scrape reads whole ints and floats."""

    def __init__(self, name: str, doc: str, labels: list[str], buckets, registry: CollectorRegistry) -> None:
        self.name, self.doc, self.label_names = name, doc, labels
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple, _TokenHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _TokenHistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _TokenHistogramChild(self.bounds)
        return child

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=self.label_names)]

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.label_names)
        for values, child in list(self._children.items()):
            counts, total = list(child.counts), 0
            buckets = []
            for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
                total += n
                buckets.append((floatToGoString(bound), total))
            fam.add_metric(list(values), buckets, child.sum)
        yield fam


class _TokenHistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.observe_n(value, 1)

    def observe_n(self, value: float, n: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += n  # the first bucket with value <= le
        self.sum += value * n


class _ClusterCollector:
    def __init__(
        self, cluster: pb.ClusterState | None, workers: list[pb.WorkerState], ingress: tuple[str, int, int]
    ) -> None:
        self.cluster = cluster
        self.workers = workers
        self.ingress = ingress

    def collect(self):
        labels = ["role", "worker"]
        running = GaugeMetricFamily(
            "pdserve_requests_running", "Requests in the running batch", labels=labels
        )
        waiting = GaugeMetricFamily(
            "pdserve_requests_waiting", "Requests queued in the engine", labels=labels
        )
        kv = GaugeMetricFamily(
            "pdserve_kv_cache_usage_ratio", "Used fraction of the KV block pool", labels=labels
        )
        hit = GaugeMetricFamily(
            "pdserve_prefix_cache_hit_ratio",
            "Prompt blocks found in the engine's prefix cache",
            labels=labels,
        )
        free = GaugeMetricFamily(
            "pdserve_kv_blocks_free", "Free (or evictable cached) KV blocks", labels=labels
        )
        total = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks in the pool", labels=labels)
        preempt = CounterMetricFamily("pdserve_preemptions", "Requests preempted for KV space", labels=labels)
        queries = CounterMetricFamily(
            "pdserve_prefix_cache_queries",
            "Prompt tokens looked up in the engine's prefix cache",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "pdserve_prefix_cache_hits", "Prompt tokens found in the engine's prefix cache", labels=labels
        )
        tier_hits = CounterMetricFamily(
            "pdserve_prefix_cache_tier_hits",
            "Prompt tokens found in the prefix cache, by the tier that held them (device, host, disk)",
            labels=[*labels, "tier"],
        )
        host_blocks = GaugeMetricFamily(
            "pdserve_kv_host_blocks", "Blocks of the prefix cache's host tier", labels=labels
        )
        host_used = GaugeMetricFamily(
            "pdserve_kv_host_blocks_used", "Host-tier blocks holding an evicted prefix block", labels=labels
        )
        host_offloaded = CounterMetricFamily(
            "pdserve_kv_host_offloaded_blocks",
            "Blocks copied from the KV pool to the host tier",
            labels=labels,
        )
        peer_blocks = CounterMetricFamily(
            "pdserve_kv_peer_blocks",
            "Prefix blocks shared between workers' host tiers (within a role), by direction (received: read "
            "from a peer and published; lent; rejected: read but failed their CRC, recomputed)",
            labels=[*labels, "direction"],
        )
        disk_blocks = GaugeMetricFamily(
            "pdserve_kv_disk_blocks", "Blocks of the prefix cache's disk tier", labels=labels
        )
        disk_used = GaugeMetricFamily(
            "pdserve_kv_disk_blocks_used", "Disk-tier blocks holding an evicted prefix block", labels=labels
        )
        disk_written = CounterMetricFamily(
            "pdserve_kv_disk_written_blocks",
            "Blocks written from the host tier to the disk tier",
            labels=labels,
        )
        disk_rejected = CounterMetricFamily(
            "pdserve_kv_disk_rejected_blocks",
            "Disk-tier blocks read back that failed their content check (recomputed)",
            labels=labels,
        )
        spec_drafts = CounterMetricFamily(
            "pdserve_spec_decode_drafts", "Speculative proposals (one sequence, one step)", labels=labels
        )
        spec_tokens = CounterMetricFamily(
            "pdserve_spec_decode_draft_tokens", "Drafted tokens verified by the target", labels=labels
        )
        spec_accepted = CounterMetricFamily(
            "pdserve_spec_decode_accepted_tokens", "Drafted tokens the target accepted", labels=labels
        )
        spec_rate = GaugeMetricFamily(
            "pdserve_spec_decode_acceptance_ratio", "Accepted / drafted tokens since start", labels=labels
        )
        spec_len = GaugeMetricFamily(
            "pdserve_spec_decode_mean_accepted_length",
            "Tokens a speculating step emits per sequence on average (accepted drafts + 1)",
            labels=labels,
        )
        spec_pos = CounterMetricFamily(
            "pdserve_spec_decode_accepted_per_position",
            "Drafts whose token at this position was accepted",
            labels=[*labels, "position"],
        )
        tbytes = CounterMetricFamily(
            "pdserve_kv_transfer_bytes", "KV bytes pulled from prefill workers", labels=["worker"]
        )
        tfail = CounterMetricFamily(
            "pdserve_kv_transfer_failures", "KV pulls that failed or timed out", labels=["worker"]
        )
        tdesc = CounterMetricFamily(
            "pdserve_kv_transfer_descriptors",
            "KV READ descriptors posted (runs of blocks)",
            labels=["worker"],
        )
        tstreamed = CounterMetricFamily(
            "pdserve_kv_transfer_streamed_bytes",
            "KV bytes read while their prompt was still being prefilled (overlapped with it)",
            labels=["worker"],
        )
        texpired = CounterMetricFamily(
            "pdserve_kv_lease_expirations",
            "Held prompts a prefill worker freed at lease expiry, never read",
            labels=["worker"],
        )
        tsec = HistogramMetricFamily(
            "pdserve_kv_transfer_seconds",
            "KV pull latency (READ start to all blocks landed)",
            labels=["worker"],
        )
        replica, streaming, queued = self.ingress
        running.add_metric(["ingress", replica], streaming)
        waiting.add_metric(["ingress", replica], queued)
        for w in self.workers:
            s, ids = w.stats, [w.role, w.worker_id]
            running.add_metric(ids, s.num_running)
            waiting.add_metric(ids, s.num_waiting)
            kv.add_metric(ids, s.kv_usage)
            free.add_metric(ids, s.num_free_blocks)
            total.add_metric(ids, s.num_blocks)
            hit.add_metric(
                ids, s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
            )
            preempt.add_metric(ids, s.num_preemptions)
            queries.add_metric(ids, s.prefix_cache_queries)
            hits.add_metric(ids, s.prefix_cache_hits)
            lower = s.prefix_cache_hits_host + s.prefix_cache_hits_disk
            tier_hits.add_metric([*ids, "device"], s.prefix_cache_hits - lower)
            if s.host_cache_blocks:
                tier_hits.add_metric([*ids, "host"], s.prefix_cache_hits_host)
                host_blocks.add_metric(ids, s.host_cache_blocks)
                host_used.add_metric(ids, s.host_cache_used)
                host_offloaded.add_metric(ids, s.host_offloaded_blocks)
                peer_blocks.add_metric([*ids, "received"], s.peer_received_blocks)
                peer_blocks.add_metric([*ids, "lent"], s.peer_lent_blocks)
                peer_blocks.add_metric([*ids, "rejected"], s.peer_rejected_blocks)
            if s.disk_cache_blocks:
                tier_hits.add_metric([*ids, "disk"], s.prefix_cache_hits_disk)
                disk_blocks.add_metric(ids, s.disk_cache_blocks)
                disk_used.add_metric(ids, s.disk_cache_used)
                disk_written.add_metric(ids, s.disk_written_blocks)
                disk_rejected.add_metric(ids, s.disk_rejected_blocks)
            if s.spec_num_drafts:
                spec_drafts.add_metric(ids, s.spec_num_drafts)
                spec_tokens.add_metric(ids, s.spec_draft_tokens)
                spec_accepted.add_metric(ids, s.spec_accepted_tokens)
                spec_rate.add_metric(ids, s.spec_accepted_tokens / max(s.spec_draft_tokens, 1))
                spec_len.add_metric(ids, 1 + s.spec_accepted_tokens / s.spec_num_drafts)
                for i, n in enumerate(s.spec_accepted_per_position):
                    spec_pos.add_metric([*ids, str(i)], n)
            if w.role == "prefill" and w.HasField("transfer_stats"):
                texpired.add_metric([w.worker_id], w.transfer_stats.expired_leases)
            if w.role == "decode" and w.HasField("transfer_stats"):
                t = w.transfer_stats
                tdesc.add_metric([w.worker_id], t.descriptors)
                tstreamed.add_metric([w.worker_id], t.streamed_bytes)
                tbytes.add_metric([w.worker_id], t.bytes)
                tfail.add_metric([w.worker_id], t.failures)
                buckets, acc = [], 0
                for bound, n in zip([*t.bucket_bounds, float("inf")], t.bucket_counts):
                    acc += n
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
                tsec.add_metric([w.worker_id], buckets, t.seconds_sum)
        yield from (running, waiting, kv, free, total, hit, preempt, queries, hits, tbytes, tfail, tsec)
        yield from (spec_drafts, spec_tokens, spec_accepted, spec_rate, spec_len, spec_pos, tdesc, texpired)
        yield from (tier_hits, host_blocks, host_used, host_offloaded, peer_blocks)
        yield from (disk_blocks, disk_used, disk_written, disk_rejected)
        yield tstreamed
        if self.cluster is not None:
            yield from router_families(self.cluster)
