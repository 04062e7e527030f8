"""What one scheduler step hands the model runner, and what the runner hands back.

New (or resumed) sequences travel in full; running ones as deltas (new block ids). The runner keeps
its own per-sequence state and appends the tokens it samples, so a running decode costs a few
integers per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewSequenceData:
    seq_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seed: int
    sample_index: int
    # Tokens to draw from this sequence's next logits: 1, or n when parallel samples fork here.
    num_samples: int = 1
    # Where the request's output starts in token_ids (penalties and bad words read it), and where
    # its prompt ends (min_tokens counts from there; the two differ for a resumed request).
    output_start: int = 0
    prompt_len: int = 0
    lora: str | None = None  # the LoRA adapter it runs (None: the base model)


@dataclass(slots=True)
class RunningSequenceData:
    seq_id: str
    new_block_ids: list[int]
    # Set instead of ``new_block_ids`` when a block in the middle of the table changed (copy-on-write).
    block_ids: list[int] | None
    num_computed_tokens: int
    num_samples: int = 1


@dataclass(slots=True)
class SchedulerOutput:
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    running_seqs: list[RunningSequenceData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_seq_ids: set[str] = field(default_factory=set)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Speculating decodes: seq_id -> k. Scheduled for 1 + k tokens (the last one and k drafts the
    # runner proposes); 1 to k + 1 come back in ``RunnerOutput.sampled``.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    # Running decodes on the fast path, in scheduling order: one token each, at these positions, into
    # a block the sequence owns already or (``decode_new_blocks``) one fresh block its token opens;
    # one sample. Kept out of ``running_seqs``: a plain decode costs two list entries, not an object,
    # and a steady batch stays one list as its sequences cross block boundaries together.
    decode_ids: list[str] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_new_blocks: dict[str, int] = field(default_factory=dict)  # seq_id -> the block appended

    def computed_before(self) -> dict[str, int]:
        """seq_id -> tokens computed before this step, for every sequence scheduled in it."""
        computed = dict(zip(self.decode_ids, self.decode_positions))
        for d in self.new_seqs:
            computed[d.seq_id] = d.num_computed_tokens
        for d in self.running_seqs:
            computed[d.seq_id] = d.num_computed_tokens
        return computed

    def spans(self) -> list[tuple[str, int, int]]:
        """(seq_id, tokens computed before this step, samples) of every scheduled sequence: new and
        running ones in order, then the fast-path decodes."""
        spans = [
            (d.seq_id, d.num_computed_tokens, d.num_samples) for d in (*self.new_seqs, *self.running_seqs)
        ]
        spans.extend((s, p, 1) for s, p in zip(self.decode_ids, self.decode_positions))
        return spans

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class RunnerOutput:
    # seq_id -> sampled tokens (1, or n for a sequence that forks; for a speculating one, its new
    # tokens in order) for sequences whose scheduled tokens reached the end of their known tokens;
    # partial prefill chunks sample nothing.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # seq_id -> per sample (per token for a speculating sequence): {token_id: logprob}, sampled first.
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # seq_id -> why its request must end with an error (a grammar no token of the model can follow).
    errors: dict[str, str] = field(default_factory=dict)
    # seq_id -> (first prompt position, logprobs of the tokens after it): prompt_logprobs, per chunk.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # A steady decode batch's samples as columns (the runner's repeat cache; not in ``sampled``):
    # one token for each of these sequences, no logprobs, no drafts. The ids list is the runner's,
    # the same object for as long as the batch repeats. ``repeat_overlapped``: the step overlapped
    # the next one, so each token is the value of its sequence's oldest placeholder.
    repeat_ids: list[str] | None = None
    repeat_tokens: list[int] | None = None
    repeat_overlapped: bool = False


@dataclass(slots=True)
class SequenceOutput:
    """One sequence's progress in one step, as the engine reports it to its caller."""

    request_id: str
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # Prefill role: the blocks now held for a peer (their KV covers the prompt) and the seed used.
    held_block_ids: list[int] | None = None
    seed: int | None = None
    # With the first output of a request that asked for prompt_logprobs: one per prompt token, the
    # first None (nothing precedes it).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class PlainTokens:
    """A step's plain outputs as columns: each one new token of a lean request (no logprobs, forks,
    hand-off) that did not end it, kept as the request and the token. A caller that takes them so
    (the engine process, which sends them as columns) skips an object per sequence per step;
    ``outputs()`` builds the ``SequenceOutput`` objects the engine would have returned."""

    requests: list = field(default_factory=list)  # engine.request.Request
    tokens: list[int] = field(default_factory=list)
    # For each output object the step returned, in order: how many of these entries precede it
    # (one step() can finish two steps: a sequence's plain token, then its finish).
    marks: list[int] = field(default_factory=list)
    # The steady decode batch whose requests these entries are, all and only (set by the update
    # that adds them in bulk; the same list object while the batch repeats): the engine process
    # sends its members once, then only its tokens (worker.engine_channel.SteadyBatchSender).
    batch: list | None = None

    def outputs(self) -> list[SequenceOutput]:
        return [
            SequenceOutput(
                r.group_id, r.sample_index, [t], None, None, None, r.prompt_len,
                r.num_cached_tokens if r.num_cached_tokens > 0 else 0,
            )
            for r, t in zip(self.requests, self.tokens)
        ]  # fmt: skip

    def merged(self, outs: list[SequenceOutput]) -> list[SequenceOutput]:
        """``outs`` (what the step returned) and these entries as objects, in the order the step
        produced them (``marks``)."""
        plain, merged, at = self.outputs(), [], 0
        for out, mark in zip(outs, self.marks):
            merged.extend(plain[at:mark])
            at = max(at, mark)
            merged.append(out)
        return merged + plain[at:]
