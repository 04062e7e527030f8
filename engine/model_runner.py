"""Turns a scheduler step into one forward pass and its samples.

The runner keeps a small state per sequence (tokens, block table, sampling fields) fed by the
scheduler's deltas, builds the flattened varlen batch (decodes first, then prefill chunks) with
positions, slot mapping and block tables, applies pending block swaps/copies, runs the model, and
samples where a sequence reached the end of its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend
from engine.batch import build_batch
from engine.kv_cache import KVLayout
from engine.kv_quant import block_rows
from engine.logits_processing import LogitsAdjustment, RowHistory
from engine.models.llama import LlamaForCausalLM
from engine.prompt_logprobs import prompt_logprobs
from engine.sampler import Sampler, SamplingBatch, sample_seed
from engine.sampling_params import SamplingParams
from engine.scheduler_output import RunnerOutput, SchedulerOutput
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
        self.decode_graphs = None  # engine.cuda_graphs.DecodeGraphRunner, set on CUDA
        self.speculator = None  # engine.spec_decode.Speculator, set when the engine speculates

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._apply_block_ops(sched)
        self._update_states(sched)
        if sched.is_empty:
            return RunnerOutput()
        # Drafts first: the verifying forward below takes each speculating sequence's drafts as input.
        drafts = self.speculator.propose(self, sched) if sched.num_spec_tokens else {}
        order = self._batch_order(sched, drafts)
        input_ids, positions, meta, sample_rows, spec_rows = self._prepare(sched, order, drafts)
        masks = self._grammar_masks(sample_rows) if self._grammar_seqs else None  # filled during the forward
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            hidden = self.decode_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
        prompt_lp = {}
        if self._prompt_lp_seqs and not self._prompt_lp_seqs.isdisjoint(sched.num_scheduled_tokens):
            prompt_lp = prompt_logprobs(self.model, hidden, self.seqs, sched, order, meta.query_start_loc)
        if sample_rows:
            rows = [r for r, _, _ in sample_rows]
            out = self._sample(self.model.compute_logits(hidden[rows]), sample_rows, masks)
        else:
            out = RunnerOutput()
        out.prompt_logprobs = prompt_lp
        if spec_rows:
            self.speculator.verify(self, hidden, spec_rows, out)
        return out

    def _batch_order(self, sched: SchedulerOutput, drafts: dict[str, list[int]]) -> list[str]:
        """Decodes first, longest context first (the attention backend groups them by length); a
        sequence that speculates this step runs as a short prefill chunk."""
        n = sched.num_scheduled_tokens
        return sorted(n, key=lambda s: (n[s] != 1 or bool(drafts.get(s)), -len(self.seqs[s].token_ids)))

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
        for seq_id in sched.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            if self.speculator is not None:
                self.speculator.drop(seq_id)
            self._grammar_seqs.discard(seq_id)
            self._prompt_lp_seqs.discard(seq_id)
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
            if new.params.prompt_logprobs is not None:
                self._prompt_lp_seqs.add(new.seq_id)
            spec = new.params.structured
            if spec is not None:
                self._grammar_seqs.add(new.seq_id)
                state = self.seqs[new.seq_id]
                state.grammar = self.structured.matcher(spec, state.token_ids[state.output_start :])
                if state.grammar.failed:  # its output so far (e.g. a peer's first token) breaks the grammar
                    self._grammar_errors[new.seq_id] = (
                        "structured output: the output so far does not follow the grammar"
                    )
        for run in sched.running_seqs:
            state = self.seqs[run.seq_id]
            if run.block_ids is not None:
                state.block_ids = list(run.block_ids)
            else:
                state.block_ids.extend(run.new_block_ids)

    def _prepare(self, sched: SchedulerOutput, order: list[str], drafts: dict[str, list[int]]):
        """The step's flat batch; a speculating sequence's span is its last token and its drafts."""
        computed = {d.seq_id: d.num_computed_tokens for d in sched.new_seqs}
        computed.update({d.seq_id: d.num_computed_tokens for d in sched.running_seqs})
        samples = {d.seq_id: d.num_samples for d in sched.new_seqs}
        samples.update({d.seq_id: d.num_samples for d in sched.running_seqs})
        spans = []
        sample_rows: list[tuple[int, str, int]] = []
        spec_rows: list[tuple[int, str, list[int]]] = []
        row = 0
        for seq_id in order:
            state = self.seqs[seq_id]
            start = computed[seq_id]
            draft = drafts.get(seq_id)
            if draft:
                toks = [state.token_ids[start], *draft]
                spec_rows.append((row, seq_id, draft))
            else:
                toks = state.token_ids[start : start + sched.num_scheduled_tokens[seq_id]]
                if start + len(toks) == len(state.token_ids):
                    sample_rows.append((row + len(toks) - 1, seq_id, samples[seq_id]))
            spans.append((toks, start, state.block_ids))
            row += len(toks)
        input_ids, positions, meta = build_batch(spans, self.layout.block_size, self.device, self.backend)
        return input_ids, positions, meta, sample_rows, spec_rows

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
        self, logits: torch.Tensor, sample_rows: list[tuple[int, str, int]], masks=None
    ) -> RunnerOutput:
        expand: list[int] = []
        rows: list[tuple[SamplingParams, int, int]] = []
        want_logprobs: list[int | None] = []
        processed: list[tuple[int, RowHistory]] = []
        holders: list[tuple[_SeqState, RowHistory]] = []
        for i, (_, seq_id, n) in enumerate(sample_rows):
            state = self.seqs[seq_id]
            p = state.params
            for s in range(n):
                if p.processes_logits:
                    history = RowHistory(
                        p,
                        state.token_ids,
                        state.output_start,
                        state.prompt_len,
                        self.eos_token_ids,
                        state.prompt_tokens,
                    )
                    processed.append((len(expand), history))
                    holders.append((state, history))
                expand.append(i)
                rows.append((p, sample_seed(state.seed, state.sample_index + s), len(state.token_ids)))
                want_logprobs.append(p.logprobs)
        if len(expand) != len(sample_rows):
            logits = logits[torch.tensor(expand, device=logits.device)]
        wanted = [k for k in want_logprobs if k is not None]
        dev = logits.device
        batch = SamplingBatch.for_rows(
            rows,
            dev,
            max_logprobs=max(wanted) if wanted else None,
            adjust=LogitsAdjustment.build(processed, dev) if processed else None,
            token_bitmask=masks.result().to(dev) if masks is not None else None,
        )
        for state, history in holders:  # a prompt's distinct tokens are gathered once per sequence
            state.prompt_tokens = history.prompt_tokens
        result = self.sampler(logits, batch)
        token_list = result.token_ids.tolist()
        out = RunnerOutput(errors=self._grammar_errors)
        self._grammar_errors = {}
        row = 0
        for _, seq_id, n in sample_rows:
            toks = token_list[row : row + n]
            out.sampled[seq_id] = toks
            state = self.seqs[seq_id]
            state.token_ids.append(toks[0])
            # Forked samples rebuild their grammar state from their tokens.
            if state.grammar is not None and not state.grammar.accept(toks[0]):
                out.errors[seq_id] = "structured output: the grammar allows none of the model's tokens here"
            if result.sampled_logprobs is not None and want_logprobs[row] is not None:
                out.logprobs[seq_id] = [
                    self._logprob_dict(result, row + s, want_logprobs[row]) for s in range(n)
                ]
            row += n
        return out

    @staticmethod
    def _logprob_dict(result, row: int, k: int) -> dict[int, float]:
        d = {int(result.token_ids[row]): float(result.sampled_logprobs[row])}
        if k:
            for tid, lp in zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist()):
                d.setdefault(tid, lp)
        return d
