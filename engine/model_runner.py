"""Turns a scheduler step into one forward pass and its samples.

The runner keeps a small state per sequence (tokens, block table, sampling fields) fed by the
scheduler's deltas, builds the flattened varlen batch (decodes first, then prefill chunks) with
positions, slot mapping and block tables, applies pending block swaps/copies, runs the model, and
samples where a sequence reached the end of its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend
from engine.device_copy import ints_on, to_device
from engine.kv_cache import KVLayout
from engine.kv_quant import block_rows
from engine.logits_processing import LogitsAdjustment
from engine.lora.batch import LoraBatch
from engine.models.llama import LlamaForCausalLM
from engine.persistent_batch import BlockTables, StepUploader, upload_step
from engine.prompt_logprobs import prompt_logprobs
from engine.repeat_inputs import RepeatInputs
from engine.request import PLACEHOLDER
from engine.sampler import Sampler, SamplerOutput, SamplingBatch, sample_seed
from engine.sampling_params import SamplingParams
from engine.sampling_plan import SamplingPlan, plan_sampling
from engine.scheduler_output import RunnerOutput, SchedulerOutput
from engine.step_batch import RepeatCache, batch_order, flatten_step, sample_rows_index, sampled_hidden
from engine.step_logprobs import host_copies, logprob_dict, logprob_lists
from engine.structured_output import GrammarState, StructuredOutputs


@dataclass(slots=True)
class _SeqState:
    token_ids: list[int]
    block_ids: list[int]
    params: SamplingParams
    seed: int
    sample_index: int
    output_start: int
    prompt_len: int
    grammar: GrammarState | None = None
    prompt_tokens: torch.Tensor | None = None  # distinct prompt tokens (repetition_penalty), on device


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        layout: KVLayout,
        kv_cache,  # a tensor, or a QuantizedKVCache
        cpu_cache,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
        structured: StructuredOutputs | None = None,
        max_model_len: int = 8192,
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # banned under min_tokens
        self.structured = structured  # grammars of structured-output requests
        self._grammar_errors: dict[str, str] = {}  # found while rebuilding a grammar's state
        # The sequences that need the per-step extras: a step without any skips them entirely.
        self._grammar_seqs: set[str] = set()
        self._prompt_lp_seqs: set[str] = set()
        self.backend = backend
        self.layout = layout
        self.kv_cache = kv_cache
        self.cpu_cache = cpu_cache
        self.device = device
        self.sampler = Sampler()
        self.seqs: dict[str, _SeqState] = {}
        # Block tables on the device, changed only where the scheduler's deltas say (persistent_batch).
        self.tables = BlockTables(-(-max_model_len // layout.block_size), device)
        self.uploader = StepUploader(device)
        self.decode_graphs = None  # engine.cuda_graphs.DecodeGraphRunner, set on CUDA
        self.speculator = None  # engine.spec_decode.Speculator, set when the engine speculates
        # Overlapped scheduling: the last launched step's sampled ids on the device, and each
        # sampled sequence's row in them (the next launch reads its placeholders' values there).
        self._inflight: tuple[torch.Tensor, dict[str, int]] | None = None
        self._repeat = RepeatCache()  # a steady decode batch's columns (engine.step_batch)
        self._steady: RepeatInputs | None = None  # ... and its inputs on the device (engine.repeat_inputs)
        self._sync_seqs: set[str] = set()  # sequences whose steps need host tokens (see needs_host_tokens)
        self._special: set[str] = set()  # with logprobs or processed logits
        self._random: set[str] = set()  # sampled at random (not greedy)
        # Forward passes run, and those replayed from a CUDA graph (the others launch every kernel
        # from Python: on a GPU a mixed prefill + decode step costs the host several times a decode's).
        self.num_forwards = 0
        self.num_graph_forwards = 0
        # LoRA (engine.lora.slots.LoraSlots, set when the engine serves adapters): each adapter
        # sequence's adapter, and the slot of each table row that runs one.
        self.lora = None
        self._lora_of: dict[str, str] = {}
        self._lora_rows: dict[int, int] = {}

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, overlap: bool = False) -> StepLaunch:
        """Queue one step's forward and sampling on the device. With ``overlap`` the sampled ids come
        back with a non-blocking copy, each sampled sequence's next token is a PLACEHOLDER that the
        next launch reads on the device, and ``collect`` (called after that launch) fills it in;
        without, the step is complete on return. A step with drafts to verify never overlaps."""
        self._apply_block_ops(sched)
        self._update_states(sched)
        launch = StepLaunch()
        if sched.is_empty:
            self._inflight = None
            launch.done = RunnerOutput()
            return launch
        # Drafts first: the verifying forward below takes each speculating sequence's drafts as input.
        drafts = self.speculator.propose(self, sched) if sched.num_spec_tokens else {}
        order, at = batch_order(sched, drafts, self.seqs, self.backend.name == "torch")
        input_ids, positions, meta, sample_rows, spec_rows, plan, launch.repeat, sample_index = self._prepare(
            sched, order, at, drafts
        )
        masks = self._grammar_masks(sample_rows) if self._grammar_seqs else None  # filled during the forward
        self.num_forwards += 1
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            self.num_graph_forwards += 1
            hidden = self.decode_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
        prompt_lp = {}
        if self._prompt_lp_seqs and not self._prompt_lp_seqs.isdisjoint(sched.num_scheduled_tokens):
            prompt_lp = prompt_logprobs(self.model, hidden, self.seqs, sched, order, meta.query_start_loc)
        launch.sample_rows, launch.plan, launch.prompt_logprobs = sample_rows, plan, prompt_lp
        if sample_rows:
            launch.result = self._sample(
                self.model.compute_logits(sampled_hidden(hidden, sample_rows, sample_index)),
                sample_rows,
                masks,
                plan,
            )
            if self._steady is not None:  # this step's samples are the next steady step's inputs
                self._steady.tokens = launch.result.token_ids
        overlap = overlap and not spec_rows and bool(sample_rows)
        if not overlap:
            self._inflight = None
            launch.done = self.collect(launch)
            if spec_rows:
                self.speculator.verify(self, hidden, spec_rows, launch.done)
            return launch
        tokens = launch.result.token_ids
        if self.device.type == "cuda":
            launch.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            launch.host_tokens.copy_(tokens, non_blocking=True)
            if launch.result.sampled_logprobs is not None:  # read after the next launch: no sync then
                launch.host_logprobs = host_copies(launch.result)
            launch.ready = torch.cuda.Event()
            launch.ready.record()
        if launch.repeat:  # the steady decode batch's columns, kept
            ids, lists, index = self._repeat.ids, self._repeat.lists, self._repeat.index
        else:
            assert {n for _, _, n in sample_rows} == {1}, "a forking sequence never overlaps"
            ids = [s for _, s, _ in sample_rows]
            lists = [self.seqs[s].token_ids for s in ids]
            index = dict(zip(ids, range(len(ids))))
        at = list(map(len, lists))
        launch.slots = dict(zip(ids, at))
        if launch.repeat:
            launch.placeholders = (ids, lists, at)
        for token_ids in lists:
            token_ids.append(PLACEHOLDER)
        self._inflight = (tokens, index)
        return launch

    def collect(self, launch: StepLaunch) -> RunnerOutput:
        """The step's RunnerOutput; for an overlapped step, waits for its sampled ids."""
        if launch.done is not None:
            return launch.done
        out = RunnerOutput(errors=self._grammar_errors)
        self._grammar_errors = {}
        out.prompt_logprobs = launch.prompt_logprobs
        result = launch.result
        if result is None:
            return out
        if launch.ready is not None:
            launch.ready.synchronize()
        token_list = (launch.host_tokens if launch.host_tokens is not None else result.token_ids).tolist()
        want_logprobs = launch.plan.want_logprobs
        slots = launch.slots
        if launch.plan.expand is None and not self._grammar_seqs:  # one plain sample per sequence
            # NOTE: every sequence, every step: C-level loops where they do.
            seqs = self.seqs
            if launch.placeholders is not None:  # the steady batch, overlapped: placeholders, as columns
                ids, lists, at = launch.placeholders
                for token_ids, i, tok in zip(lists, at, token_list):
                    token_ids[i] = tok  # (the list of a sequence that ended meanwhile is no one's)
                out.repeat_ids, out.repeat_tokens, out.repeat_overlapped = ids, token_list, True
                return out
            if not slots and launch.repeat:  # the steady decode batch: its next inputs are these
                out.repeat_ids, out.repeat_tokens = self._repeat.ids, token_list
                self._repeat.sampled = token_list
                for token_ids, tok in zip(self._repeat.lists, token_list):
                    token_ids.append(tok)
                return out
            ids = [s for _, s, _ in launch.sample_rows]
            out.sampled.update(zip(ids, [[t] for t in token_list]))
            if not slots:
                for token_ids, tok in zip([seqs[s].token_ids for s in ids], token_list):
                    token_ids.append(tok)
                return out
            for seq_id, tok in zip(ids, token_list):  # fill the placeholder, unless it ended meanwhile
                state = seqs.get(seq_id)
                if state is not None and state.token_ids[slots[seq_id]] == PLACEHOLDER:
                    state.token_ids[slots[seq_id]] = tok
            return out
        row = 0
        step_logprobs = None  # the step's logprobs as host lists, read once when a row wants them
        for _, seq_id, n in launch.sample_rows:
            toks = token_list[row : row + n]
            out.sampled[seq_id] = toks
            state = self.seqs.get(seq_id)
            if slots:  # overlapped: fill the placeholder, unless the sequence ended meanwhile
                if state is not None and state.token_ids[slots[seq_id]] == PLACEHOLDER:
                    state.token_ids[slots[seq_id]] = toks[0]
            else:
                state.token_ids.append(toks[0])
                # Forked samples rebuild their grammar state from their tokens.
                if state.grammar is not None and not state.grammar.accept(toks[0]):
                    out.errors[seq_id] = (
                        "structured output: the grammar allows none of the model's tokens here"
                    )
            if want_logprobs and want_logprobs[row] is not None and result.sampled_logprobs is not None:
                if step_logprobs is None:
                    step_logprobs = logprob_lists(launch.host_logprobs or result)
                out.logprobs[seq_id] = [
                    logprob_dict(token_list[row + s], step_logprobs, row + s, want_logprobs[row])
                    for s in range(n)
                ]
            row += n
        return out

    def needs_host_tokens(self, sched: SchedulerOutput) -> bool:
        """Whether a step must see its sequences' latest tokens on the host before it launches (so
        it cannot overlap the step before): logits processing (penalties, bad words, min_tokens,
        logit_bias), a grammar, prompt logprobs, forking samples, drafts to propose."""
        if sched.num_spec_tokens or self.speculator is not None:
            return True
        seqs = self.seqs
        sync = self._sync_seqs
        for d in sched.new_seqs:
            if d.num_samples > 1 or _needs_host_tokens(d.params):
                return True
        if sync and not sync.isdisjoint(sched.num_scheduled_tokens):
            return True
        return any(d.num_samples > 1 for d in sched.running_seqs) if seqs else False

    @property
    def kv_blocks(self) -> torch.Tensor:
        """Row ``b`` is block ``b``'s whole region (with its scales, when quantized): what a swap,
        a copy-on-write or a transfer moves."""
        return block_rows(self.kv_cache)

    def _apply_block_ops(self, sched: SchedulerOutput) -> None:
        kv = self.kv_blocks
        cpu = block_rows(self.cpu_cache) if self.cpu_cache is not None else None
        for src, dst in sched.blocks_to_swap_out:
            cpu[dst].copy_(kv[src])
        for src, dst in sched.blocks_to_swap_in:
            kv[dst].copy_(cpu[src])
        for src, dst in sched.blocks_to_copy:
            kv[dst].copy_(kv[src])
        if sched.blocks_to_copy and self.speculator is not None:
            self.speculator.copy_blocks(sched.blocks_to_copy)

    def _update_states(self, sched: SchedulerOutput) -> None:
        tables = self.tables
        if sched.finished_seq_ids or sched.new_seqs:  # rows and token lists change
            self._repeat, self._steady = RepeatCache(), None
        for seq_id in sched.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            if self._lora_of:
                self.unpin_lora(seq_id)
            tables.remove(seq_id)
            if self.speculator is not None:
                self.speculator.drop(seq_id)
            self._grammar_seqs.discard(seq_id)
            self._prompt_lp_seqs.discard(seq_id)
            self._sync_seqs.discard(seq_id)
            self._special.discard(seq_id)
            self._random.discard(seq_id)
        for new in sched.new_seqs:
            self.seqs[new.seq_id] = _SeqState(
                list(new.token_ids),
                list(new.block_ids),
                new.params,
                new.seed,
                new.sample_index,
                new.output_start,
                new.prompt_len,
            )
            if self._lora_of:
                self.unpin_lora(new.seq_id)
            tables.remove(new.seq_id)  # a resumed sequence starts its row afresh
            tables.add(new.seq_id, new.block_ids)
            if new.lora is not None:
                self._lora_of[new.seq_id] = new.lora
                self._lora_rows[tables.row_of[new.seq_id]] = self.lora.acquire(new.lora)
            if new.params.prompt_logprobs is not None:
                self._prompt_lp_seqs.add(new.seq_id)
            if _needs_host_tokens(new.params):
                self._sync_seqs.add(new.seq_id)
            p = new.params
            if p.processes_logits or p.logprobs is not None:
                self._special.add(new.seq_id)
            if not (p.temperature == 0 or p.top_k == 1):
                self._random.add(new.seq_id)
            tables.set_sampling(
                new.seq_id, p.temperature, p.top_k, p.top_p, p.min_p, sample_seed(new.seed, new.sample_index)
            )
            spec = new.params.structured
            if spec is not None:
                self._grammar_seqs.add(new.seq_id)
                state = self.seqs[new.seq_id]
                state.grammar = self.structured.matcher(spec, state.token_ids[state.output_start :])
                if state.grammar.failed:  # its output so far (e.g. a peer's first token) breaks the grammar
                    self._grammar_errors[new.seq_id] = (
                        "structured output: the output so far does not follow the grammar"
                    )
        seqs = self.seqs
        if sched.decode_new_blocks:
            for seq_id, block in sched.decode_new_blocks.items():
                seqs[seq_id].block_ids.append(block)
            tables.append_each(sched.decode_new_blocks)
        for run in sched.running_seqs:
            state = self.seqs[run.seq_id]
            if run.block_ids is not None:
                state.block_ids = list(run.block_ids)
                tables.replace(run.seq_id, run.block_ids)
            elif run.new_block_ids:
                state.block_ids.extend(run.new_block_ids)
                tables.append(run.seq_id, run.new_block_ids)

    def _prepare(self, sched: SchedulerOutput, order: list[str], at: list[int], drafts: dict[str, list[int]]):
        """The step's inputs on the device: a steady decode batch's advanced there
        (``engine.repeat_inputs``), others built as a flat batch (``engine.step_batch``)."""
        steady, self._steady = self._steady, None  # valid for the step right after the one it served
        steady_ok = (
            len(order) == len(at) and not drafts and not self._lora_rows and not self._grammar_seqs
            and not self._prompt_lp_seqs
        )  # fmt: skip
        if steady is not None and steady_ok and order == self._repeat.ids:
            advanced = steady.advance(at, self.tables, self.uploader, self.layout.block_size, self.backend)
            if advanced is not None:
                self._steady, self._repeat.sampled = steady, None
                inputs, plan = advanced
                return (
                    inputs.input_ids,
                    inputs.positions,
                    inputs.meta,
                    self._repeat.sample_rows,
                    [],
                    plan,
                    True,
                    None,
                )
        inflight = self._inflight
        step = flatten_step(
            sched, order, at, drafts, self.seqs, self.tables.row_of, inflight[1] if inflight else None,
            self._repeat,
        )  # fmt: skip
        flat, sample_rows = step.flat, step.sample_rows
        plan = plan_sampling(
            self.seqs, self._special, self._random, self.tables.row_of, self.eos_token_ids,
            sample_rows, step.sample_spans, bool(step.forks),
        )  # fmt: skip
        patches = (step.patch_dst, step.patch_src, inflight[0]) if step.patch_dst else None
        inputs = upload_step(
            flat, self.tables, self.uploader, self.layout.block_size, self.backend, plan.scalars, patches,
            sample_rows_index(sample_rows),
        )  # fmt: skip
        plan.tensors = inputs.sampling
        if steady_ok and step.repeat and plan.expand is None:
            self._steady = RepeatInputs.capture(inputs, self._repeat.rows, at, self.tables, plan)
        if self._lora_rows:
            lora_rows = self._lora_rows
            token_slots = [lora_rows.get(r, -1) for r in flat.token_rows]
            inputs.meta.lora = LoraBatch.build(self.lora, token_slots, self.device)
        return (
            inputs.input_ids, inputs.positions, inputs.meta, sample_rows, step.spec_rows, plan, step.repeat,
            inputs.sample_index,
        )  # fmt: skip

    def unpin_lora(self, seq_id: str) -> None:
        """Release the adapter slot sequence ``seq_id`` pins (a no-op once released)."""
        name = self._lora_of.pop(seq_id, None)
        if name is not None:
            self._lora_rows.pop(self.tables.row_of[seq_id], None)
            self.lora.release(name)

    def _grammar_masks(self, sample_rows: list[tuple[int, str, int]]):
        """A future of the step's token bitmask (one row per sample), or None without grammars."""
        rows: list[tuple[int, GrammarState]] = []
        k = 0
        for _, seq_id, n in sample_rows:
            grammar = self.seqs[seq_id].grammar
            for _ in range(n):
                if grammar is not None and grammar.constraining:
                    rows.append((k, grammar))
                k += 1
        return self.structured.fill_async(rows, k) if rows else None

    def _sample(
        self, logits: torch.Tensor, sample_rows: list[tuple[int, str, int]], masks, plan: SamplingPlan
    ) -> SamplerOutput:
        if plan.expand is not None and len(plan.expand) != len(sample_rows):
            logits = logits.index_select(0, ints_on(plan.expand, logits.device))
        wanted = [k for k in plan.want_logprobs if k is not None] if plan.want_logprobs else []
        dev = logits.device
        batch = SamplingBatch.from_device(
            plan.flags,
            plan.tensors,
            max_logprobs=max(wanted) if wanted else None,
            adjust=LogitsAdjustment.build(plan.processed, dev) if plan.processed else None,
            token_bitmask=to_device(masks.result(), dev) if masks is not None else None,
        )
        for state, history in plan.holders:  # a prompt's distinct tokens are gathered once per sequence
            state.prompt_tokens = history.prompt_tokens
        return self.sampler(logits, batch)


@dataclass(slots=True)
class StepLaunch:
    """A launched step: what ``collect`` needs to turn its samples into a RunnerOutput."""

    sample_rows: list[tuple[int, str, int]] = field(default_factory=list)
    plan: SamplingPlan | None = None
    result: SamplerOutput | None = None
    prompt_logprobs: dict = field(default_factory=dict)
    host_tokens: torch.Tensor | None = None  # pinned; filled by the non-blocking copy
    host_logprobs: SamplerOutput | None = None  # the same for its logprobs, when it computed them
    ready: torch.cuda.Event | None = None  # recorded after that copy
    slots: dict[str, int] = field(default_factory=dict)  # overlapped: seq_id -> its placeholder's index
    done: RunnerOutput | None = None  # set when the step did not overlap
    repeat: bool = False  # it samples the runner's repeat cache's ids alone, in order
    placeholders: tuple | None = None  # overlapped ``repeat``: (ids, token lists, placeholder indices)

    @property
    def sampled_ids(self) -> list[str]:
        return list(self.slots)


def _needs_host_tokens(params: SamplingParams) -> bool:
    return params.processes_logits or params.structured is not None or params.prompt_logprobs is not None
