"""Request migration: when a decode worker is lost mid-stream, the router resumes the request on
another one, and the caller's stream just goes on.

A request's stream is relayed attempt by attempt. An attempt (route -> prefill -> decode, or decode
alone) ends in one of three ways: the request finished (done); the caller went away or a worker
refused the request (passed on as before); or its decode worker was *lost* (``DecodeLost``):

- its call failed once it had started (connection reset, the server stopped, the process died),
- it sent ``StreamError(code="unavailable")`` (its engine loop failed, or it shut down and handed
  the request off),
- its stream ended before every sample finished,
- the ``ProgressWatch`` found it stalled: no message for longer than the stream's deadline, or a
  ``Progress`` message saying its engine thread has been blocked that long.

A lost worker that stalled, failed or was unreachable is *suspect* for ``suspect_s`` (not routed to while others
exist). The request then resumes (``Resumption``): the prompt plus every token already relayed is the
new prompt, ``max_tokens`` shrinks by those tokens and the seed is kept (the caller's, else the one
the prefill worker drew), so every position samples what one engine would sample there: greedy
output is identical, seeded output reproducible. The new attempt is routed like a new request (the
lost worker excluded), so the prompt's cached prefix is hit on the prefill or decode worker that
holds it. Usage in the final ``Finished`` is rewritten to the caller's prompt. Logprobs come with
each token. Text, stop strings and detokenization live in the ingress, which sees one continuous
token stream. A request is refused (``MigrationRefused``, UNAVAILABLE) once it has moved
``max_migrations`` times, when no other decode worker is live, and for n > 1 (its samples diverged;
one prompt cannot continue them all).

The stall deadline of a stream on worker W: ``stall_timeout_s`` when set, else
max(``stall_floor_s``, ``stall_step_multiple`` x W's longest recent engine step, as its ``Progress``
messages report it). Silence is judged against the deadline plus W's keepalive interval. A healthy
worker busy with a long prefill, or a request queued behind others, keeps sending ``Progress``
with a small ``blocked_ms``, so only a worker that stopped (SIGSTOP, a hung engine thread, a
partitioned network) trips it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2 as pb
from proto.convert import stop_reason_fields
from proto.quiet_timer import QuietTimer

logger = logging.getLogger(__name__)

# A decode call failing with these once it started means the worker (or the way to it) is gone.
MIGRATABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


@dataclass(frozen=True, slots=True)
class MigrationOptions:
    max_migrations: int = 3  # moves per request; 0 turns migration off
    stall_timeout_s: float | None = None  # a fixed stall deadline instead of the step-derived one
    stall_floor_s: float = 5.0  # the step-derived deadline is never shorter
    stall_step_multiple: float = 20.0  # deadline = this x the worker's step budget (engine.step_budget)
    suspect_s: float = 30.0  # a stalled, failed or unreachable worker is not routed to for this long

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")
        if self.stall_floor_s <= 0 or self.stall_step_multiple <= 0 or self.suspect_s < 0:
            raise ValueError("stall_floor_s and stall_step_multiple must be positive, suspect_s >= 0")

    def deadline_s(self, step_s: float) -> float:
        """The stall deadline of a worker whose longest recent engine step took ``step_s``."""
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return max(self.stall_floor_s, self.stall_step_multiple * step_s)


class DecodeLost(Exception):
    """The request's decode worker was lost mid-stream; ``stalled``/``failed``: it is suspect.
    ``reason`` is for the router's log (it may name addresses: a connection's error); the caller
    gets ``cause``, a few words (default: the reason up to its first colon)."""

    def __init__(
        self, worker_id: str, reason: str, *, suspect: bool = True, cause: str = "", epoch: int | None = None
    ) -> None:
        super().__init__(f"decode worker {worker_id} lost: {reason}")
        self.worker_id = worker_id
        self.epoch = epoch  # the incarnation lost (None: not known)
        self.reason = reason
        self.suspect = suspect
        self.cause = cause or reason.split(":", 1)[0]

    def public(self) -> str:
        return f"decode worker {self.worker_id} lost ({self.cause})"

    def replaced_by(self, current) -> bool:
        """Whether ``current``, the id's record registered now, is a newer incarnation than the one
        lost (a replacement registered under its id, then the old one handed its requests off): the
        id is then no suspect and not lost to the request, or the replacement would be excluded."""
        return self.epoch is not None and replaced(self.epoch, current)


def replaced(epoch: int, current) -> bool:
    """Whether ``current`` (a worker id's record registered now, or None) is a newer incarnation than
    the one of ``epoch``."""
    return current is not None and current.epoch > epoch


class MigrationRefused(Exception):
    """The request cannot be resumed elsewhere; the caller gets ``code`` (UNAVAILABLE: a 503)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


class Resumption:
    """What a request has relayed so far, and the request that continues it."""

    __slots__ = ("finished", "migrations", "n", "offset", "params", "prompt", "seed", "tokens")

    def __init__(self, prompt: list[int], params: pb.SamplingParams, n: int) -> None:
        self.prompt = prompt
        self.params = params
        self.n = n
        self.seed: int | None = params.seed if params.HasField("seed") else None
        self.tokens: list[int] = []  # relayed to the caller (sample 0; n > 1 never resumes)
        self.offset = 0  # tokens already relayed when the current attempt started
        self.finished = 0  # samples that ended
        self.migrations = 0

    def request(self) -> tuple[list[int], pb.SamplingParams]:
        """The current attempt's prompt and params."""
        if not self.offset:
            return self.prompt, self.params
        rest = continued(self.params, self.offset)
        if self.seed is not None:
            rest.seed = self.seed
        return [*self.prompt, *self.tokens], rest

    def attempt_id(self, request_id: str) -> str:
        """The id workers know the current attempt by: the request's own, then one per move."""
        return request_id if not self.migrations else f"{request_id}~m{self.migrations}"

    def relay(self, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        """Record a message on its way to the caller (usage rewritten to the caller's prompt)."""
        kind = msg.WhichOneof("kind")
        if kind == "tokens":
            if msg.tokens.sample_index == 0:
                self.tokens.extend(msg.tokens.token_ids)
            if self.offset and msg.tokens.HasField("cached_tokens"):  # the caller's prompt's share
                msg.tokens.cached_tokens = min(msg.tokens.cached_tokens, len(self.prompt))
        elif kind == "finished":
            self.finished += 1
            if self.offset:
                u = msg.finished.usage
                u.prompt_tokens = len(self.prompt)
                u.completion_tokens += self.offset
                u.cached_tokens = min(u.cached_tokens, len(self.prompt))
        return msg

    def ended_by_itself(self) -> pb.GenerateResponse | None:
        """The ``Finished`` the lost worker would have sent next, when the relayed tokens already end
        the request (its last message lost on the way), else None."""
        p = self.params
        if self.n > 1:
            return None
        if len(self.tokens) >= p.max_tokens:
            reason, stop = "length", None
        elif self.tokens and self.tokens[-1] in p.stop_token_ids:
            reason, stop = "stop", self.tokens[-1]
        else:
            return None
        usage = pb.Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens))
        finished = pb.Finished(finish_reason=reason, usage=usage, **stop_reason_fields(stop))
        return pb.GenerateResponse(finished=finished)

    def resume(
        self, lost: DecodeLost, options: MigrationOptions, others: int, deadline: float | None
    ) -> None:
        """Move on to the next attempt, or raise ``MigrationRefused`` saying why not."""
        what = f"{lost.public()}; the request"  # (the full reason is the router's log's)
        if deadline is not None and time.monotonic() >= deadline:
            raise MigrationRefused(f"{what} reached its deadline", grpc.StatusCode.DEADLINE_EXCEEDED)
        if self.n > 1:
            raise MigrationRefused(f"{what} has n = {self.n} samples, which cannot be resumed elsewhere")
        if self.migrations >= options.max_migrations:
            raise MigrationRefused(
                f"{what} was already moved {self.migrations} times (limit {options.max_migrations})"
            )
        if not others:
            raise MigrationRefused(f"{what} cannot be resumed: no other decode worker is available")
        self.migrations += 1
        self.offset = len(self.tokens)


def continuation(prompt: list[int], params: pb.SamplingParams, handle: pb.KVHandle):
    """The request as a decode worker computes it without the handle: the first token (already
    streamed) joins the prompt, one token less is left, and the prefill's seed keeps positions'
    samples what one engine would draw."""
    rest = continued(params, 1)
    rest.seed = handle.seed
    return [*prompt, handle.first_token], rest


def continued(params: pb.SamplingParams, tokens: int) -> pb.SamplingParams:
    """``params`` once ``tokens`` of the request's output joined its prompt: budgets lowered, and the
    tokens marked as output for penalties and bad words (as ``SamplingParams.continued``)."""
    rest = pb.SamplingParams()
    rest.CopyFrom(params)
    rest.max_tokens = params.max_tokens - tokens
    rest.min_tokens = max(0, params.min_tokens - tokens)
    rest.prior_output_tokens = params.prior_output_tokens + tokens
    rest.ClearField("prompt_logprobs")  # sent with the first token already
    return rest


class ProgressWatch:
    """Per-stream stall deadlines, from what each decode worker's ``Progress`` messages say."""

    def __init__(self, options: MigrationOptions) -> None:
        self.options = options
        self._step_s: dict[str, float] = {}  # worker -> its step budget (engine.step_budget)
        self._interval_s: dict[str, float] = {}  # worker -> its keepalive interval

    def deadline_s(self, worker_id: str) -> float:
        return self.options.deadline_s(self._step_s.get(worker_id, 0.0))

    async def watch(
        self, stream: AsyncIterator[pb.GenerateResponse], worker_id: str, epoch: int | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """``stream``'s messages, ``Progress`` consumed here; raises ``DecodeLost`` on a stall."""
        it = aiter(stream)
        quiet = QuietTimer(lambda: self.deadline_s(worker_id) + self._interval_s.get(worker_id, 0.0))
        try:
            while True:
                try:
                    msg = await quiet.wait(anext(it))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    silence = self.deadline_s(worker_id) + self._interval_s.get(worker_id, 0.0)
                    raise DecodeLost(worker_id, f"stalled: silent for {silence:.1f}s", epoch=epoch) from None
                if msg.WhichOneof("kind") != "progress":
                    yield msg
                    continue
                p = msg.progress
                limit = self.deadline_s(worker_id)  # from what was known before this message
                self._step_s[worker_id] = p.step_ms / 1e3
                self._interval_s[worker_id] = p.interval_ms / 1e3
                if p.blocked_ms / 1e3 > limit:
                    raise DecodeLost(
                        worker_id,
                        f"stalled: its engine made no progress for {p.blocked_ms / 1e3:.1f}s",
                        epoch=epoch,
                    )
        finally:
            quiet.close()
