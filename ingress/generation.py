"""One request's generation as the ingress sees it: the router's token stream turned into text.

Per sample: tokens are detokenized incrementally; stop strings are matched here (text never reaches
the workers) and the text that could still become a stop string is held back while streaming; a
stop-string match ends the sample, and the stream is cancelled once every sample has ended, which
aborts the request on its decode worker. Router/worker failures become ``APIError``s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from engine.detokenizer import IncrementalDetokenizer
from ingress.metrics import IngressMetrics
from ingress.openai_protocol import APIError
from ingress.request_timing import IngressStamps
from ingress.request_validation import GenerationRequest
from ingress.token_text import TokenLogprob, TokenTexts
from proto.convert import logprobs_from_proto, stop_reason_of
from router.client import RouterClient
from router.policies import DRAINING_MESSAGE

_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "request_failed"),  # the model cannot satisfy it
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request"),
    grpc.StatusCode.NOT_FOUND: (404, "model_not_found"),  # no worker serves the adapter it names
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
GRAMMAR_REFUSAL = "cannot compile the "  # how the engine words a grammar it cannot compile
_STREAM_STATUS = {
    "invalid_argument": 400,
    "request_failed": 400,
    "kv_transfer_failed": 503,
    "unavailable": 503,
}


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list | None = None  # with the request's first tokens, when asked


@dataclass(slots=True)
class _Sample:
    detok: IncrementalDetokenizer
    emitted: int = 0  # characters of detok.text already handed out
    tokens: int = 0
    decoded: int = 0  # characters the tokens so far added to the text (before a stop-string cut)
    split: bool = False  # the last token ended inside a UTF-8 sequence
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_token_at: float | None = None  # when its last tokens came (inter-token latency)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class Generation:
    request_id: str
    req: GenerationRequest
    tokenizer: object
    metrics: IngressMetrics
    texts: TokenTexts | None = None  # logprob token strings; one per tokenizer, shared by requests
    started: float = 0.0  # the request's arrival (its stamps'): TTFT and E2E metrics count from it
    first_token_at: float | None = None
    route: tuple[str, str] | None = None  # (prefill worker, decode worker)
    samples: list[_Sample] = field(default_factory=list)
    usage: Usage | None = None
    hold: int = 0  # characters held back while streaming: a stop string may still complete there
    stamps: IngressStamps | None = None  # hop timing; arrival defaults to this object's creation
    prompt_logprobs: list[dict[int, float] | None] | None = None  # position 0: None

    def __post_init__(self) -> None:
        now = time.perf_counter()  # the request is parsed and valid
        if self.stamps is None:
            self.stamps = IngressStamps(now)
        self.stamps.validated = self.stamps.admitted = now
        self.started = self.stamps.arrived
        p = self.req.params
        self.samples = [
            _Sample(IncrementalDetokenizer(self.tokenizer, self.req.prompt_ids, p)) for _ in range(p.n)
        ]
        self.usage = Usage(len(self.req.prompt_ids))
        if self.texts is None and self.req.logprobs is not None:
            self.texts = TokenTexts(self.tokenizer)
        self.hold = max(0, max((len(s) for s in p.stop), default=0) - 1) if self.req.stream else 0

    async def events(self, router: RouterClient, timeout_s: float) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields the new text (and logprobs, finish reasons) of each router message."""
        g = self.req
        self.stamps.router_called = time.perf_counter()
        stream = router.generate(self.request_id, g.prompt_ids, g.params, g.priority, timeout_s)
        try:
            async with aclosing(self._follow(stream)) as follow:
                async for deltas in follow:
                    yield deltas
        finally:  # once per request, however it ends
            self.metrics.count_tokens(self.usage.prompt_tokens, self.usage.completion_tokens)
        if not self.ended:
            raise APIError(500, "the generation stream ended before every sample finished", code="internal")
        now = self.stamps.finished = time.perf_counter()
        self.metrics.observe_e2e(now - self.started)
        self.metrics.observe_hops(self.stamps.hops())

    async def _follow(self, stream) -> AsyncIterator[list[ChoiceDelta]]:
        async with aclosing(stream):
            try:
                async for msg in stream:
                    kind = msg.WhichOneof("kind")
                    if kind == "tokens":
                        deltas = self._on_tokens(msg.tokens)
                    elif kind == "finished":
                        deltas = self._on_finished(msg.finished)
                    elif kind == "error":
                        raise APIError(
                            _STREAM_STATUS.get(msg.error.code, 500),
                            msg.error.message,
                            code=msg.error.code,
                            param=self._param_of(msg.error.message),
                        )
                    else:
                        self.route = (msg.route.prefill_worker, msg.route.decode_worker)
                        continue
                    if deltas:
                        yield deltas
                    if self.ended:
                        break
            except grpc.aio.AioRpcError as exc:
                status, code = _GRPC_STATUS.get(exc.code(), (500, "internal"))
                details = exc.details() or exc.code().name.lower()
                if exc.code() == grpc.StatusCode.UNAVAILABLE and details == DRAINING_MESSAGE:
                    code = "draining"
                param = self._param_of(details) if status == 400 else "model" if status == 404 else None
                raise APIError(status, details, code=code, param=param) from exc

    def _param_of(self, message: str) -> str | None:
        """The request field a worker's refusal is about: the structured output's, for a grammar
        that does not compile (``engine.structured_output``)."""
        return self.req.structured_param if message.startswith(GRAMMAR_REFUSAL) else None

    @property
    def ended(self) -> bool:
        """Every sample has its finish reason: nothing but the stream's end is left to come."""
        samples = self.samples
        if len(samples) == 1:  # asked after every message: the common case without a generator
            return samples[0].finish_reason is not None
        return all(s.finish_reason is not None for s in samples)

    def _on_tokens(self, chunk) -> list[ChoiceDelta]:
        s = self.samples[chunk.sample_index]
        if s.finish_reason is not None:  # already ended by a stop string; the worker ran on
            return []
        now = time.perf_counter()
        n = len(chunk.token_ids)
        if self.first_token_at is None:
            self.first_token_at = self.stamps.first_token = now
            if not self.req.stream:  # the whole answer goes out at the end; the stream stamps its own
                self.stamps.first_out = now
            self.metrics.observe_ttft(now - self.started)
        # Gaps between one sample's tokens (n > 1: the samples' messages interleave, a step apart).
        if s.last_token_at is None:
            if n > 1:
                self.metrics.observe_token_gap(0.0, n - 1)
        else:
            self.metrics.observe_token_gap(now - s.last_token_at, n)
        s.last_token_at = now
        if chunk.HasField("cached_tokens"):  # the first chunk's: a stop string may end it before Finished
            self.usage.cached_tokens = max(self.usage.cached_tokens, chunk.cached_tokens)
        ids = list(chunk.token_ids)
        stop = s.detok.add(ids)
        if stop is not None:  # the tokens after the one that completed it never happened
            s.finish_reason, s.stop_reason = "stop", stop
            ids = ids[: s.detok.kept]
        s.tokens += len(ids)
        self.usage.completion_tokens += len(ids)
        logprobs = self._logprobs(s, ids, chunk.logprobs) if self.req.logprobs is not None else []
        delta = self._delta(chunk.sample_index, s, logprobs)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = [None, *(logprobs_from_proto(e) or {} for e in chunk.prompt_logprobs)]
            delta.prompt_logprobs = self.prompt_logprobs
        return [delta]

    def _on_finished(self, fin) -> list[ChoiceDelta]:
        s = self.samples[fin.sample_index]
        self.usage.cached_tokens = max(self.usage.cached_tokens, fin.usage.cached_tokens)
        if fin.HasField("timing"):
            self.stamps.workers = fin.timing
        if s.finish_reason is not None:
            return []
        s.detok.flush()  # bytes of a character the output ended inside
        s.finish_reason = fin.finish_reason
        s.stop_reason = stop_reason_of(fin)
        return [self._delta(fin.sample_index, s, [])]

    def _delta(self, index: int, s: _Sample, logprobs: list[TokenLogprob]) -> ChoiceDelta:
        end = (
            len(s.detok.text)
            if s.finish_reason is not None
            else max(s.emitted, len(s.detok.text) - self.hold)
        )
        text, s.emitted = s.detok.text[s.emitted : end], end
        return ChoiceDelta(index, text, logprobs, s.finish_reason, s.stop_reason)

    def _logprobs(self, s: _Sample, ids: list[int], entries) -> list[TokenLogprob]:
        """The chunk's tokens as logprob entries; called right after ``s.detok.add(ids)``."""
        k = self.req.logprobs or 0
        pieces = s.detok.pieces
        sampled = self.texts.sampled(ids, pieces, s.split)
        s.split = bool(pieces) and pieces[-1] is None
        history = s.detok.tokens
        if s.detok.stop_token is not None:  # the stop token that ended it: not detokenized, still a token
            history = [*history, s.detok.stop_token]
        base = len(history) - len(ids)
        out = []
        for j, (tid, lp, (token, raw)) in enumerate(zip(ids, entries, sampled)):
            # -inf (a token outside top-k/top-p) is not JSON: clamp like other OpenAI servers do.
            pairs = [(e.token_id, max(e.logprob, -9999.0)) for e in lp.entries]
            value = next((v for t, v in pairs if t == tid), -9999.0)
            top = []
            for t, v in sorted(pairs, key=lambda p: -p[1])[:k]:
                alt = (
                    (token, raw)
                    if t == tid
                    else self.texts.alternative(history[max(0, base + j - 4) : base + j], t)
                )
                top.append((*alt, v))
            out.append(TokenLogprob(token, raw, value, top, s.decoded))
            s.decoded += len(pieces[j] or "")
        return out

    def text(self, index: int) -> str:
        return self.samples[index].detok.text

    def finish(self, index: int) -> tuple[str | None, str | None]:
        s = self.samples[index]
        return s.finish_reason, s.stop_reason
