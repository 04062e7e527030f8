"""The engine: requests in, one ``step()`` at a time, sequence outputs out.

``step()`` is the whole loop: schedule, execute, update. Every role uses this class: the offline
``LLM``, the prefill worker (which stops a request after its first token) and the decode worker.
Requests are validated when added; one that can never fit (prompt + max_tokens beyond the model's
context or beyond the whole KV pool) is refused at once with a ``ValueError``.
"""

from __future__ import annotations

import logging
import random
import time
from operator import attrgetter

from engine.attention import get_attention_backend
from engine.config import EngineConfig, usable_device
from engine.core_lora import LoraMixin
from engine.core_tiers import TierMixin
from engine.core_transfer import TransferMixin
from engine.cpu_threads import apply_thread_policy
from engine.kv_cache import KVLayout, gpu_kv_budget, num_blocks_for_budget
from engine.kv_cache_manager import KVCacheManager
from engine.kv_disk_prefetch import DiskPrefetch
from engine.kv_disk_tier import attach_disk_tier
from engine.kv_host_tier import attach_host_tier, check_host_room
from engine.kv_quant import first_blocks, storage_dtype
from engine.limits import RequestLimits
from engine.model_runner import ModelRunner
from engine.models import load_model, resolve_model_path
from engine.models.loader import eos_token_ids
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import PlainTokens, SequenceOutput
from engine.spec_decode import attach_cache, build_speculator, draft_block_bytes
from engine.stats import EngineStats, disk_tier_stats, host_tier_stats, spec_stats
from engine.step_budget import StepBudget
from engine.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)
PREFILL_STEP_TOKENS = 64  # a step this large is mostly prompt work: it measures prefill cost per token
_new_token_ids = attrgetter("new_token_ids")


class EngineCore(TransferMixin, LoraMixin, TierMixin):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = usable_device(config.device)  # before a model download it could not use
        self.model_path = resolve_model_path(config.model)
        # The process's intra-op pool, before anything runs a parallel op: one engine each.
        apply_thread_policy(self.device.type, config.cpu_threads)
        backend = get_attention_backend(config.attention_backend, config.device)
        t0 = time.perf_counter()
        self.model = load_model(self.model_path, config.dtype, config.device, backend)
        self.spec = self.model.spec
        self.eos_token_ids = eos_token_ids(self.model_path)
        logger.info("model loaded in %.2fs", time.perf_counter() - t0)
        self._setup_lora()  # its device slots before the KV cache takes the free memory
        limit = self.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context of {limit}")
        self.max_model_len = config.max_model_len or limit
        self.layout = KVLayout.from_spec(
            self.spec, config.block_size, config.dtype, storage_dtype(config.kv_cache_dtype)
        )
        spec_cfg = config.speculative
        self.speculator, draft = None, None
        if spec_cfg is not None:
            self.speculator, draft = build_speculator(
                spec_cfg, self.model, self.model_path, config.tokenizer, self.max_model_len,
                lambda path: load_model(path, config.dtype, config.device, backend),
            )  # fmt: skip
            logger.info("speculative decoding: %s", spec_cfg.describe())
        num_blocks = config.num_blocks or self._blocks_from_budget(
            draft_block_bytes(draft, config.block_size, config.dtype)
        )
        num_cpu_blocks = int(config.swap_space * (1 << 30)) // self.layout.block_bytes
        # One block more than the pool hands out: the pad block that padded rows of a CUDA-graph
        # decode batch write to (engine/cuda_graphs.py). The pool, NIXL and everything else see
        # only the first num_blocks.
        kv_cache_with_pad = self.layout.allocate(num_blocks + 1, self.device)
        kv_cache = first_blocks(kv_cache_with_pad, num_blocks)
        if num_cpu_blocks:  # (after the pool: on a CPU engine it takes the same memory)
            check_host_room("swap_space", config.swap_space, num_cpu_blocks * self.layout.block_bytes)
        cpu_cache = self.layout.allocate(num_cpu_blocks, "cpu") if num_cpu_blocks else None
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB), %d CPU swap blocks",
            num_blocks,
            config.block_size,
            num_blocks * self.layout.block_bytes / 2**20,
            num_cpu_blocks,
        )
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            salt=self.prefix_salt,
        )
        if config.kv_host_cache_gib and config.enable_prefix_caching:
            slots = attach_host_tier(self.kv, kv_cache, config.kv_host_cache_gib)
            logger.info("KV host tier: %d blocks (%.2f GiB)", slots, config.kv_host_cache_gib)
            self.kv.host_tier.recording = False
            if config.kv_disk_cache_gib:
                attach_disk_tier(self.kv, kv_cache, config.kv_disk_cache_gib, config.kv_disk_cache_dir)
                self.kv.disk_tier.recording = False
        self.kv.pool.recording = False  # until someone reads the events (drain_kv_events)
        self.prefetch = DiskPrefetch(self.kv) if self.kv.disk_tier is not None else None
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            admission_margin=config.admission_margin,
            itl_target_ms=config.itl_target_ms,
            num_spec_tokens=spec_cfg.num_speculative_tokens if spec_cfg else 0,
            spec_max_batch=spec_cfg.disable_by_batch_size if spec_cfg else None,
            max_loras=config.max_loras if self.lora_slots is not None else 0,
        )
        self.structured = StructuredOutputs(
            config.tokenizer or self.model_path, self.spec.vocab_size, self.eos_token_ids
        )
        self.runner = ModelRunner(
            self.model,
            backend,
            self.layout,
            kv_cache,
            cpu_cache,
            self.device,
            self.eos_token_ids,
            self.structured,
            max_model_len=self.max_model_len,
        )
        self.runner.lora = self.lora_slots
        if self.speculator is not None:
            attach_cache(self.speculator, self.model, draft, kv_cache, self.layout, num_blocks, backend)
            self.runner.speculator = self.speculator
        from engine.cuda_graphs import DecodeGraphRunner, graph_max_batch, graphs_apply

        graphs = graphs_apply(config, self.device.type, backend.name, self.layout.kv_dtype, self.model)
        if graphs:
            t0 = time.perf_counter()
            try:
                self.runner.decode_graphs = DecodeGraphRunner(
                    self.model,
                    backend,
                    kv_cache_with_pad,
                    config.block_size,
                    self.max_model_len,
                    graph_max_batch(config),
                    lora=self.lora_slots,
                    mixed=config.cuda_graph_mixed,
                )
                logger.info("decode CUDA graphs captured in %.1fs", time.perf_counter() - t0)
            except RuntimeError as exc:  # e.g. an op that cannot be captured: correct, just slower
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", exc)
                self.runner.decode_graphs = None
        self._rng = random.Random(config.seed)
        self._inflight = None  # overlapped scheduling: (sched, launch, t0) of the step on the device
        # The serving loop's step budget (``engine.step_budget``), told each step's tokens once scheduled.
        self.step_budget: StepBudget | None = None
        # A prefill worker's engine: a request ends at its first token, which then holds its KV for a
        # peer; those steps run without overlap (they are prompt compute, which keeps a GPU busy).
        self._serves_prefill_only = False
        self._generation_tokens = 0
        self._prefill_s_per_token: float | None = None

    @property
    def prefix_salt(self) -> str:
        """The prefix-cache hashes' namespace: ``cache_salt``, and the KV dtype when quantized (a
        block of int8 KV is no hit for a float32 request, on this engine or in the router's index)."""
        kv = self.config.kv_cache_dtype
        return self.config.cache_salt if kv == "auto" else f"{self.config.cache_salt}|kv={kv}"

    def _blocks_from_budget(self, draft_block_bytes: int) -> int:
        """Blocks that fit the KV budget; a draft model's cache has a block per target block."""
        if self.device.type == "cuda":
            budget = gpu_kv_budget(self.device, self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes
        share = self.layout.block_bytes / (self.layout.block_bytes + draft_block_bytes)
        return num_blocks_for_budget(self.layout, int(budget * share))

    # Requests ---------------------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        """What this engine can ever serve (``validate`` checks it; a worker's edge can too)."""
        return RequestLimits(
            vocab_size=self.spec.vocab_size,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.kv.block_size,
            num_blocks=self.kv.num_blocks,
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request this engine can never serve."""
        self.limits.check(prompt_token_ids, params)
        self.lora_args(params.lora)  # an adapter it does not serve: UnknownAdapterError (a ValueError)
        if params.structured is not None:
            self.structured.compile(params.structured)  # a bad schema is refused here, once

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request. ``prefill_only`` (prefill role): stop after the first token and hold the
        prompt's blocks until ``release_held``; the output carries their ids and the seed used."""
        self._check_new_id(request_id, params.n if isinstance(params.n, int) else 1)
        params = self.limits.resolved(len(prompt_token_ids), params)  # max_tokens None: up to the context
        self.validate(prompt_token_ids, params)
        if prefill_only and params.n != 1:
            raise ValueError("disaggregated prefill serves n = 1 only; run n > 1 requests aggregated")
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            seed=self._seed_for(params),
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            arrival_time=arrival_time,
            prefill_only=prefill_only,
            **self.lora_args(params.lora),
        )
        if not self._stage(req):
            self.scheduler.add(req)
        self._serves_prefill_only |= prefill_only

    def _check_new_id(self, request_id: str, n: int = 1) -> None:
        """Refuses an id in use: a group's, a sample's (``<group>#<k>``, forked or to come), held or
        staged KV's; and one whose samples' ids would be (a group of n forks ``<id>#1`` on)."""
        staged = self.prefetch is not None and request_id in self.prefetch
        groups, requests = self.scheduler.groups, self.scheduler.requests
        base, mark, _ = request_id.rpartition("#")
        if (
            request_id in groups
            or request_id in requests
            or request_id in self.kv.held
            or staged
            or (mark and base in groups)
            or any(f"{request_id}#{k}" in requests for k in range(1, n))
        ):
            raise ValueError(f"request id {request_id!r} is already in use")

    def _seed_for(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._rng.getrandbits(63)

    def abort_request(self, request_id: str) -> list[SequenceOutput]:
        return self._finish_group(request_id, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, error: str) -> list[SequenceOutput]:
        """End a request with an error (finish_reason "error"); frees its blocks."""
        return self._finish_group(request_id, RequestStatus.FINISHED_ERROR, error)

    def stop_sequence(self, request_id: str, sample_index: int, stop_reason: str) -> SequenceOutput | None:
        """End one sample because its text reached a stop string."""
        seq_id = request_id if sample_index == 0 else f"{request_id}#{sample_index}"
        req = self.scheduler.finish(seq_id, RequestStatus.FINISHED_STOPPED)
        if req is None:
            return None
        req.stop_reason = stop_reason
        return SequenceOutput(request_id, sample_index, [], finish_reason="stop", stop_reason=stop_reason)

    def _finish_group(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> list[SequenceOutput]:
        outs = []
        staged = self.prefetch.abort(request_id) if self.prefetch is not None else None
        if staged is not None:  # waiting for its prefix's reads: it leaves before the queue
            outs.append(SequenceOutput(request_id, 0, [], finish_reason=status.finish_reason, error=error))
        for seq_id in self.scheduler.sequences_of(request_id):
            req = self.scheduler.finish(seq_id, status)
            if req is not None:
                # Before its first token a request with n > 1 has not forked: its other samples end
                # with it (they never ran).
                for index in (req.sample_index, *range(1, req.pending_forks + 1)):
                    outs.append(
                        SequenceOutput(
                            req.group_id, index, [], finish_reason=status.finish_reason, error=error
                        )
                    )
        return outs

    def has_unfinished(self) -> bool:
        staged = self.prefetch is not None and self.prefetch.busy()
        return self.scheduler.has_unfinished() or self._inflight is not None or staged

    def has_work(self) -> bool:
        """Whether ``step()`` has anything to do (a request whose KV is being pulled does not count;
        one whose disk-tier prefix is read ahead does: ``step`` takes it once read)."""
        staged = self.prefetch is not None and self.prefetch.busy()
        return self.scheduler.has_work() or self._inflight is not None or staged

    # The loop ---------------------------------------------------------------------------------

    def step(self, plain: PlainTokens | None = None) -> list[SequenceOutput]:
        """Schedule, launch and finish one step. Overlapped (``async_scheduling``), this step is
        scheduled and launched while the previous one still runs on the device, and the outputs
        returned are the previous step's: each sequence's tokens arrive one step later, and a
        sequence that stops computes one token more, which is dropped. With ``plain``, the plain
        outputs (a lean request's token that did not end it) are added to it as columns instead of
        returned, and ``plain.marks`` says where each returned output falls among them: a step that
        follows an overlapped one finishes both, so a sequence can have a plain token and then its
        finish in one call."""
        self._admit_staged()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t_launch = time.perf_counter()  # the scheduling (and host-tier copies on CPU) are behind
        if self.step_budget is not None:
            self.step_budget.started(sched.total_num_scheduled_tokens)
        overlap = self.overlap and not self._needs_host_tokens(sched)
        outs: list[SequenceOutput] = []
        if not overlap and self._inflight is not None:
            outs = self._finish_inflight(plain)  # this step reads tokens on the host: they must be in
        try:
            launch = self.runner.launch(sched, overlap=overlap)
        except Exception as exc:  # a bad batch fails its requests, never the engine
            failed = self._fail_step(sched, exc)
            if plain is not None:
                plain.marks.extend([len(plain.tokens)] * len(failed))
            return outs + failed
        if launch.slots:
            self.scheduler.expect_tokens(
                launch.placeholders[0] if launch.placeholders else launch.sampled_ids
            )
        if self._inflight is not None:
            outs = self._finish_inflight(plain)
        if launch.slots:
            self._inflight = (sched, launch, t0)
        else:
            outs.extend(self._finish(sched, self.runner.collect(launch), t0, plain))
            if self.kv.host_blocks is not None:  # only a host tier's cost model reads it
                self._observe_prefill(sched, time.perf_counter() - t_launch)
        return outs

    def _observe_prefill(self, sched, seconds: float) -> None:
        """The prefill cost per token a host-tier hit is weighed against, from steps that are mostly
        prompt tokens (their forward and sampling, not the scheduling before it)."""
        total = sched.total_num_scheduled_tokens
        prompt = sum(n for n in sched.num_scheduled_tokens.values() if n > 1)
        if prompt < PREFILL_STEP_TOKENS or prompt < 0.75 * total:
            return
        old = self._prefill_s_per_token
        self._prefill_s_per_token = seconds / total if old is None else 0.8 * old + 0.2 * seconds / total

    @property
    def overlap(self) -> bool:
        """Whether steps overlap (``async_scheduling``)."""
        return self.config.async_scheduling == "on"

    def _needs_host_tokens(self, sched) -> bool:
        if self.runner.needs_host_tokens(sched):
            return True
        return self._serves_prefill_only

    def _finish_inflight(self, plain: PlainTokens | None = None) -> list[SequenceOutput]:
        sched, launch, t0 = self._inflight
        self._inflight = None
        return self._finish(sched, self.runner.collect(launch), t0, plain)

    def _fail_step(self, sched, exc: Exception) -> list[SequenceOutput]:
        logger.error(
            "model step failed; failing the %d scheduled sequences",
            len(sched.num_scheduled_tokens),
            exc_info=exc,
        )
        outs = []
        requests = self.scheduler.requests
        for seq_id, num_new in sched.num_scheduled_tokens.items():
            if seq_id in requests:  # what the step was to write was registered as cached: no more
                req = requests[seq_id]
                self.kv.forget_uncomputed(req, req.num_computed_tokens - num_new)
        groups = {requests[s].group_id for s in sched.num_scheduled_tokens if s in requests}
        for g in groups:
            outs.extend(self._finish_group(g, RequestStatus.FINISHED_ERROR, f"engine error: {exc}"))
        return outs

    def _finish(self, sched, result, t0: float, plain: PlainTokens | None = None) -> list[SequenceOutput]:
        for seq_id in result.errors:  # its sample is not kept, nor handed off (prefill role)
            result.sampled.pop(seq_id, None)
        before = len(plain.tokens) if plain is not None else 0
        outs = self.scheduler.update(sched, result, plain)
        for seq_id, error in result.errors.items():
            req = self.scheduler.requests.get(seq_id)
            if req is not None:
                outs.extend(self._finish_group(req.group_id, RequestStatus.FINISHED_ERROR, error))
        if self.scheduler.batching is not None:  # the fair policy sizes later steps from this one's time
            self.scheduler.batching.observe(sched.total_num_scheduled_tokens, time.perf_counter() - t0)
        self._generation_tokens += sum(map(len, map(_new_token_ids, outs)))
        if plain is not None:
            self._generation_tokens += len(plain.tokens) - before
            plain.marks.extend([len(plain.tokens)] * len(outs))  # after this update's plain tokens
        return outs

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens queued or mid-prefill that will be computed: the load signal a router
        balances prefill work on. A waiting request's cached prefix is not work, so it is left out
        (as the router counts the work it sends), else a warm worker would look busiest."""
        s = self.scheduler
        kv = self.kv
        staged = self.prefetch.requests() if self.prefetch is not None else []
        pending = sum(
            r.num_tokens
            - r.num_computed_tokens
            - (kv.find_prefix_hit(r).num_tokens if not r.num_computed_tokens else 0)
            for r in (*s.waiting, *staged)
        )
        return pending + sum(
            r.num_tokens - r.num_computed_tokens
            for r in s.running
            if r.num_tokens - r.num_computed_tokens > 1
        )

    def close(self) -> None:
        """Release what the engine holds outside its memory (the disk tier's file). Idempotent."""
        self.kv.close()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + (len(self.prefetch.requests()) if self.prefetch else 0),
            num_swapped=len(s.swapped),
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=s.num_preemptions,
            num_swap_outs=s.num_swap_outs,
            num_held=len(self.kv.held),
            num_transferring=len(s.transferring),
            prompt_tokens=s.num_prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_steps=self.runner.num_forwards,
            num_graph_steps=self.runner.num_graph_forwards,
            **host_tier_stats(self.kv),
            **disk_tier_stats(self.kv),
            **spec_stats(self.speculator),
        )
