"""One sequence's lifecycle inside the engine.

States: WAITING (queued; also after preemption by recompute) -> RUNNING (has KV blocks; computed
tokens catch up with total tokens: several steps for a chunked prompt, then one per decoded token)
-> SWAPPED (preempted with its blocks copied to the CPU pool; back to RUNNING when swapped in)
-> FINISHED_* (blocks freed). Disaggregation adds two detours: a prefill-only request finishes after
its first token with its blocks *held* for a peer to read (freed on release); a request whose prompt
KV is pulled from a peer starts in TRANSFERRING (blocks allocated, not scheduled) and joins RUNNING
when the pull completes, or WAITING (recompute) when it fails. A request with ``n`` > 1 runs as one sequence until its prompt is
computed; then ``n`` - 1 child sequences fork from it and share its blocks copy-on-write.
"""

from __future__ import annotations

import enum
import time

from engine.block_hash import BlockHash, hash_blocks, hash_next_block
from engine.sampling_params import SamplingParams

# Overlapped scheduling: a token sampled by the step still running on the device; the scheduler
# counts it (the next step decodes it) before its value is known, and ``Scheduler.update`` fills it.
PLACEHOLDER = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    TRANSFERRING = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A sequence the scheduler moves through its states; ``request_id`` is unique per sequence."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        arrival_time: float | None = None,
        group_id: str | None = None,
        sample_index: int = 0,
        prefill_only: bool = False,
        lora: str | None = None,
        lora_salt: str = "",
    ) -> None:
        self.request_id = request_id
        # The LoRA adapter it runs (None: the base model), and its prefix-cache namespace: KV computed
        # under one adapter is never a hit for another (the adapter's weights change every layer's K/V).
        self.lora = lora
        self.lora_salt = lora_salt
        self.group_id = group_id if group_id is not None else request_id
        self.sample_index = sample_index
        self.params = params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.prompt_len = len(prompt_token_ids)
        # The prompt's last ``prior_output_tokens`` are this request's own earlier output (a resumed
        # request, a recomputed hand-off): logits processing counts them as output.
        self.output_start = self.prompt_len - params.prior_output_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[dict[int, float]] = []
        # prompt_logprobs: position i + 1's token given the ones before it; filled chunk by chunk (a
        # recompute after preemption writes the same values again), sent with the first output.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * (self.prompt_len - 1) if params.prompt_logprobs is not None else None
        )
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 until then
        self.num_preemptions = 0
        # Forks still owed: children are created when the prompt's last chunk has run.
        self.pending_forks = params.n - 1 if sample_index == 0 else 0
        self.block_hashes: list[BlockHash] = []
        # Its prefix blocks the disk tier read into the host tier before its admission
        # (engine/kv_disk_prefetch.py): host hits that count as disk hits.
        self.read_ahead: frozenset[BlockHash] = frozenset()
        self.error: str | None = None
        # Prefill role: stop after the first token and hold the blocks for a peer to read.
        self.prefill_only = prefill_only
        # Trailing PLACEHOLDER tokens: sampled by steps still in flight (overlapped scheduling).
        self.num_placeholders = 0
        # The lean decode path (``StepResults.update``): no logprobs, forks or hand-off to report,
        # and only a token of ``stop_token_set`` or the length reaching ``stop_len`` (or the model's
        # limit) can end it; anything else sampled is a plain append.
        self.lean = (
            params.logprobs is None and params.prompt_logprobs is None and params.n == 1 and not prefill_only
        )
        self.stop_token_set = (frozenset() if params.ignore_eos else eos_token_ids) | frozenset(
            params.stop_token_ids
        )
        self.stop_len = self.prompt_len + params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens

    def fork(self, index: int) -> Request:
        """Parallel sample ``index`` of this request, forked after its prompt (same computed state;
        the caller shares the blocks)."""
        child = Request(
            f"{self.group_id}#{index}",
            self.token_ids[: self.prompt_len],
            self.params,
            seed=self.seed,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            arrival_time=self.arrival_time,
            group_id=self.group_id,
            sample_index=index,
            lora=self.lora,
            lora_salt=self.lora_salt,
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        return child

    def update_block_hashes(self, block_size: int, salt: str) -> None:
        """Extend the hash chain over any newly full blocks of ``token_ids``."""
        done = len(self.block_hashes)
        known = len(self.token_ids) - self.num_placeholders  # a placeholder's block waits for its value
        if (done + 1) * block_size <= known:
            parent = self.block_hashes[-1] if done else None
            if (done + 2) * block_size > known:  # one block filled (a decode's): no chunking
                start = done * block_size
                tokens = self.token_ids[start : start + block_size]
                self.block_hashes.append(hash_next_block(parent, tokens, salt + self.lora_salt))
                return
            tokens = self.token_ids if known == len(self.token_ids) else self.token_ids[:known]
            salt += self.lora_salt
            self.block_hashes.extend(hash_blocks(tokens, block_size, salt, parent, start_block=done))

    def append_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def record_prompt_logprobs(self, start: int, entries: list[dict[int, float]]) -> None:
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[start : start + len(entries)] = entries

    def first_output_prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """The prompt's logprobs (the first token's None), on the request's first output only."""
        if self.prompt_logprobs is None or self.sample_index != 0 or self.num_output_tokens != 1:
            return None
        return [None, *self.prompt_logprobs]

    def check_stop(self, max_model_len: int, at: int | None = None) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended, or filled in at index ``at``
        (overlapped scheduling: placeholders may follow it); stop strings live elsewhere."""
        # NOTE: runs for every sequence every step; plain attribute reads on purpose.
        tokens = self.token_ids
        if at is None:
            last, n = tokens[-1], len(tokens)
        else:
            last, n = tokens[at], at + 1
        params = self.params
        if last in self.eos_token_ids and not params.ignore_eos:
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if n - self.prompt_len >= params.max_tokens or n >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
