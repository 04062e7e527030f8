"""The OpenAI endpoints' logic: validate, admit, generate through the router, answer in OpenAI's shapes.

A request's life in the ingress: body read (size-capped) -> parsed and validated (any failure: a 4xx
with OpenAI's error schema, no worker touched; a body over ``INLINE_BODY_BYTES`` is parsed, templated
and tokenized on a thread pool, so a multi-megabyte prompt never stalls the streams on the loop) -> admitted (a slot among ``max_concurrent_requests``,
or a place among ``max_queued_requests`` waiting for one; beyond that 429 + Retry-After) -> streamed
from the router -> answered as JSON or SSE. A streaming answer starts only once the first token (or
an error) is in, so early failures keep their HTTP status. A client that goes away cancels the
router stream, which aborts the request on its workers and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager

from ingress.completion_batch import plan_completion, serve_plan
from ingress.generation import ChoiceDelta, Generation
from ingress.metrics import IngressMetrics
from ingress.model_info import ModelInfo
from ingress.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, status_of
from ingress.options import IngressOptions
from ingress.prompt_logprobs import vllm_prompt_logprobs
from ingress.request_timing import TIMING_FIELD, IngressStamps
from ingress.request_validation import GenerationRequest, parse_body, validate_chat
from ingress.token_text import TokenTexts
from ingress.tool_calls import ToolStream, parse_tool_calls
from router.client import RouterClient

logger = logging.getLogger(__name__)

# Bodies up to this size are validated on the event loop; larger ones on the pool. Measured with the
# tiny model's tokenizer: the hand-off costs ~0.3 ms, a 87-byte body takes 0.08 ms inline, a 4 KiB one
# ~0.9 ms (so the loop never stalls for more than about a millisecond), 16 KiB ~3.4 ms.
INLINE_BODY_BYTES = 4 << 10
TOKENIZER_THREADS = 2


class Admission:
    """A bounded queue in front of the router: ``limit`` streams at once, ``queue`` more may wait.

    A refusal's ``Retry-After`` is the time the queue ahead would take to drain at the rate slots
    were released lately (the last ``RATE_WINDOW`` releases, within ``RATE_HORIZON_S``), clamped to
    [1, 60] s; before any release was seen, one second per ``limit`` queued."""

    RATE_WINDOW = 64
    RATE_HORIZON_S = 60.0

    def __init__(self, limit: int, queue: int | None = None) -> None:
        self.limit = limit
        self.queue = 2 * limit if queue is None else queue
        self.running = 0
        self.waiting = 0
        self._cond = asyncio.Condition()
        self._released: deque[float] = deque(maxlen=self.RATE_WINDOW)

    def drain_rate(self, now: float) -> float | None:
        """Slots released per second lately, or None without two recent releases."""
        recent = [t for t in self._released if now - t <= self.RATE_HORIZON_S]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return None
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def retry_after_s(self, now: float) -> int:
        rate = self.drain_rate(now)
        ahead = self.waiting + 1
        estimate = ahead / rate if rate else ahead / self.limit
        return max(1, min(60, math.ceil(estimate)))

    @asynccontextmanager
    async def slot(self):
        async with self._cond:
            if self.running >= self.limit:
                if self.waiting >= self.queue:
                    retry = self.retry_after_s(time.monotonic())
                    raise APIError(
                        429,
                        f"server overloaded: {self.running} requests running and {self.waiting} queued",
                        code="overloaded",
                        headers={"Retry-After": str(retry)},
                    )
                self.waiting += 1
                try:
                    await self._cond.wait_for(lambda: self.running < self.limit)
                except BaseException:
                    # A waiter cancelled as a release woke it (its client left) passes the wake-up
                    # on: Python before 3.13 drops it, and the others would wait by a free slot.
                    if self.running < self.limit:
                        self._cond.notify()
                    raise
                finally:
                    self.waiting -= 1
            self.running += 1
        try:
            yield
        finally:
            async with self._cond:
                self.running -= 1
                self._released.append(time.monotonic())
                self._cond.notify()


class OpenAIServing:
    def __init__(
        self, info: ModelInfo, options: IngressOptions, router: RouterClient, metrics: IngressMetrics
    ) -> None:
        self.info = info
        self.options = options
        self.router = router
        self.metrics = metrics
        self.admission = Admission(options.max_concurrent_requests, options.max_queued_requests)
        self.draining = False
        self.texts = TokenTexts(info.tokenizer)
        # NOTE: the tokenizer is shared by these threads and the loop; encode() with one
        # (truncation-free) configuration only reads it, so concurrent calls are safe.
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="ingress-tokenize")

    def close(self) -> None:
        self.draining = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    # Endpoints ---------------------------------------------------------------------------------

    async def models(self) -> dict:
        """The base model, then each LoRA adapter the cluster serves (``parent``: the base)."""
        await self.info.adapters.refresh(self.router)
        card = {"id": self.info.name, "object": "model", "created": 0, "owned_by": "pdserve"}
        card["max_model_len"] = self.info.max_model_len
        if self.info.tiny:
            card["description"] = "tiny random-weight demo model: its text is meaningless"
        cards = [card]
        for name in self.info.adapters:
            cards.append({**card, "id": name, "parent": self.info.name, "root": self.info.name})
            cards[-1].pop("description", None)
        return {"object": "list", "data": cards}

    async def completions(self, body: bytes, arrived: float | None = None, timing: bool = False):
        """``arrived``: when the HTTP handler took the request (perf_counter); ``timing``: return
        the request's hop timing with the answer."""
        stamps = IngressStamps(arrived if arrived is not None else time.perf_counter())
        plan = await self._validated(body, CompletionRequest, plan_completion)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if plan.single:
            return await self._serve(plan.parts[0], rid, stamps, timing)
        return await serve_plan(self, plan, rid, stamps)

    async def chat(self, body: bytes, arrived: float | None = None, timing: bool = False):
        stamps = IngressStamps(arrived if arrived is not None else time.perf_counter())
        req = await self._validated(body, ChatCompletionRequest, validate_chat)
        return await self._serve(req, f"chatcmpl-{uuid.uuid4().hex}", stamps, timing)

    async def _validated(self, body, model_cls, validate) -> GenerationRequest:
        def run() -> GenerationRequest:
            return validate(parse_body(body, model_cls), self.info, self.options)

        async def checked() -> GenerationRequest:
            if len(body) <= INLINE_BODY_BYTES:
                return run()
            return await asyncio.get_running_loop().run_in_executor(self._pool, run)

        try:
            if self.draining:
                raise APIError(503, "server is shutting down", code="draining")
            try:
                return await checked()
            except APIError as exc:  # a model we do not know may be an adapter loaded since: ask
                if exc.code != "model_not_found" or not await self.info.adapters.refresh(self.router):
                    raise
            return await checked()
        except APIError as exc:
            self.metrics.count("client_error" if exc.status < 500 else "rejected")
            raise

    # Generation --------------------------------------------------------------------------------

    async def admit(self):
        """An entered admission slot (the caller exits it once the request is over), or APIError 429
        (counted as rejected) when the queue is full."""
        slot = self.admission.slot()
        try:
            await slot.__aenter__()
        except APIError:
            self.metrics.count("rejected")
            raise
        except BaseException as exc:  # the client left while queued: counted like any request
            self.metrics.count(status_of(exc))
            raise
        return slot

    async def _serve(self, req: GenerationRequest, rid: str, stamps: IngressStamps, timing: bool):
        """A dict (non-streaming) or an async iterator of SSE lines (streaming); APIError on failure.
        With ``timing`` the answer carries the hop timing (``TIMING_FIELD``: in the dict, or in the
        stream's last chunk)."""
        gen = Generation(rid, req, self.info.tokenizer, self.metrics, self.texts, stamps=stamps)
        slot = await self.admit()
        stamps.admitted = time.perf_counter()
        events = gen.events(self.router, self.options.request_timeout_s)
        if not req.stream:
            try:
                choices: dict[int, list] = {i: [] for i in range(req.params.n)}
                async for deltas in events:
                    for d in deltas:
                        choices[d.index].extend(d.logprobs)
                self.metrics.count("success")
                answer = self._full_response(rid, req, gen, choices)
                if timing:
                    answer[TIMING_FIELD] = stamps.hops()
                return answer
            except BaseException as exc:
                self.metrics.count(status_of(exc))
                raise
            finally:
                await events.aclose()
                await slot.__aexit__(None, None, None)
        try:
            first = await anext(events, None)
            if first is None:
                raise APIError(500, "the generation stream ended without output", code="internal")
        except BaseException as exc:
            await events.aclose()
            await slot.__aexit__(None, None, None)
            self.metrics.count(status_of(exc))
            raise
        return self._sse(rid, req, gen, first, events, slot, timing)

    async def _sse(self, rid, req, gen: Generation, first, events, slot, timing) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        model = req.params.lora or self.info.name  # the adapter the request named, else the base
        status = "error"
        # The events after the last sample ended (its finish, the usage, [DONE]) come out of one step
        # of the loop: they leave in one write, not three.
        tail = b""
        try:
            async with aclosing(events):
                # With include_usage, every chunk but the usage one says "usage": null (OpenAI's spec).
                usage = _NO_USAGE if req.include_usage else None
                if req.chat:  # OpenAI opens every choice with the assistant role
                    for i in range(req.params.n):
                        yield _sse(_chunk(rid, obj, created, model, [_chat_delta(i, "", role=True)], usage))
                # Once per request: every chunk's fields around its choices, serialized (the same
                # bytes as json.dumps of the whole chunk; the key is the only unescaped '"choices"').
                head, end = _sse(_chunk(rid, obj, created, model, [0], usage)).split(b'"choices":[0]', 1)
                batch: list[ChoiceDelta] | None = first
                gen.stamps.first_out = time.perf_counter()
                tools = {i: ToolStream(req.tools) for i in range(req.params.n)} if req.tools else None
                plain = tools is None and req.logprobs is None and req.prompt_logprobs is None
                while batch is not None:
                    choices = [
                        _plain_choice(req.chat, d.index, d.text)
                        if plain and d.finish_reason is None
                        else self._stream_choice(req, d, tools)
                        for d in batch
                    ]
                    choices = [c if isinstance(c, bytes) else _dumps(c) for c in choices if c is not None]
                    if choices:  # (none: a tool call held back, nothing to say yet)
                        tail += head + b'"choices":[' + b",".join(choices) + b"]" + end
                    if tail and not gen.ended:  # no later event is known yet: out now
                        yield tail
                        tail = b""
                    batch = await anext(events, None)
            if req.include_usage or timing:  # OpenAI's usage chunk: no choices
                last = _chunk(rid, obj, created, model, [])
                if req.include_usage:
                    last["usage"] = gen.usage.to_dict()
                if timing:
                    last[TIMING_FIELD] = gen.stamps.hops()
                tail += _sse(last)
            status = "success"
        except APIError as exc:
            logger.warning("%s failed mid-stream: %s", rid, exc.message)
            tail += _sse(exc.body())
        except BaseException as exc:
            status = status_of(exc)
            raise
        finally:
            self.metrics.count(status)
            await slot.__aexit__(None, None, None)
        yield tail + b"data: [DONE]\n\n"

    def _stream_choice(self, req: GenerationRequest, d: ChoiceDelta, tools=None) -> dict | None:
        """The choice's part of a chunk; None when it has nothing to say (a tool call being held
        back, without logprobs to send)."""
        reason = d.finish_reason
        if req.chat:
            text, calls = d.text, []
            if tools is not None:  # content as it comes, calls once the choice ended
                text = tools[d.index].feed(d.text)
                if reason is not None:
                    rest, calls = tools[d.index].finish(reason)
                    text += rest
                elif not text and req.logprobs is None:
                    return None
            c = _chat_delta(d.index, text)
            if calls:  # as OpenAI streams a call: no content beside it unless some came before
                c["delta"] = {
                    "content": text or None,
                    "tool_calls": [{"index": k, **x} for k, x in enumerate(calls)],
                }
                reason = "tool_calls"
            c["logprobs"] = {"content": _chat_logprobs(d.logprobs)} if req.logprobs is not None else None
        else:
            c = {"index": d.index, "text": d.text}
            c["logprobs"] = _completion_logprobs(d.logprobs) if req.logprobs is not None else None
            if d.prompt_logprobs is not None and req.prompt_logprobs is not None:
                c["prompt_logprobs"] = vllm_prompt_logprobs(
                    d.prompt_logprobs, req.prompt_ids, req.prompt_logprobs, self.info.tokenizer
                )
        c["finish_reason"] = reason
        if reason is not None:
            c["stop_reason"] = d.stop_reason
        return c

    def _full_response(self, rid, req: GenerationRequest, gen: Generation, logprobs: dict[int, list]) -> dict:
        choices = []
        for i in range(req.params.n):
            reason, stop = gen.finish(i)
            if req.chat:
                c = {"index": i, "message": {"role": "assistant", "content": gen.text(i)}}
                if req.tools is not None and reason == "stop":  # a call cut by max_tokens is text
                    content, calls = parse_tool_calls(req.tools, gen.text(i))
                    if calls:
                        c["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                        reason = "tool_calls"
                c["logprobs"] = {"content": _chat_logprobs(logprobs[i])} if req.logprobs is not None else None
            else:
                c = {"index": i, "text": gen.text(i)}
                c["logprobs"] = _completion_logprobs(logprobs[i]) if req.logprobs is not None else None
                if req.prompt_logprobs is not None:
                    c["prompt_logprobs"] = vllm_prompt_logprobs(
                        gen.prompt_logprobs or [], req.prompt_ids, req.prompt_logprobs, self.info.tokenizer
                    )
            c.update(finish_reason=reason, stop_reason=stop)
            choices.append(c)
        return {
            "id": rid,
            "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": req.params.lora or self.info.name,
            "choices": choices,
            "usage": gen.usage.to_dict(),
        }


# One encoder for every chunk: ``json.dumps`` with any non-default argument builds a new one per call.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _dumps(obj) -> bytes:
    return _ENCODE(obj).encode()


_TEXT_CHOICE = b'{"index":%d,"text":%b,"logprobs":null,"finish_reason":null}'
_CHAT_CHOICE = b'{"index":%d,"delta":{"content":%b},"logprobs":null,"finish_reason":null}'


def _plain_choice(chat: bool, index: int, text: str) -> bytes:
    """A streamed choice of text alone (no logprobs, tools or finish): the bytes ``_dumps`` writes
    for ``_stream_choice``'s dict, with only the text encoded (per token, most of a chunk's JSON)."""
    return (_CHAT_CHOICE if chat else _TEXT_CHOICE) % (index, _ENCODE(text).encode())


def _sse(obj: dict) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


_NO_USAGE: dict = {}  # ``_chunk``'s usage for "usage": null (None leaves the field out)


def _chunk(rid: str, obj: str, created: int, model: str, choices: list, usage: dict | None = None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage or None
    return out


def _chat_delta(index: int, text: str, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": text} if role else {"content": text}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def _completion_logprobs(entries) -> dict:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_with_sampled({t: v for t, _, v in e.top}, e.token, e.logprob) for e in entries],
        "text_offset": [e.offset for e in entries],
    }


def _with_sampled(top: dict, token: str, logprob: float) -> dict:
    """A completions ``top_logprobs`` entry: the k best and the sampled token, which OpenAI's
    completions always return ("up to logprobs+1 elements"; chat's stay at k)."""
    top.setdefault(token, logprob)
    return top


def _chat_logprobs(entries) -> list[dict]:
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.raw),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(raw)} for t, raw, v in e.top],
        }
        for e in entries
    ]
