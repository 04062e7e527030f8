"""Completions with several prompts, ``best_of`` or ``echo``: one request split into the single-prompt
generations the rest of the ingress serves, and their answers joined in OpenAI's shape.

Choice ``i * n + j`` is sample j of prompt i, as OpenAI indexes them. ``best_of`` = k > n generates k
samples per prompt (the engine computes the prompt once and forks the samples from it, sharing its KV
blocks copy-on-write) and returns the n with the highest mean token logprob, OpenAI's "best"; such a
request cannot stream (OpenAI's rule). ``echo`` puts each prompt's text before its choices' text (a
stream sends it as each choice's first chunk); with ``logprobs`` the prompt's tokens also lead the
choice's logprobs lists, OpenAI's way (not streamed). ``usage`` adds up every generation, best_of's extra
samples included. Each prompt is a request of its own to the router; the whole request takes one
admission slot, and a client that leaves (or one prompt that fails) ends every prompt's generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ingress.generation import Generation, Usage
from ingress.model_info import ModelInfo
from ingress.openai_protocol import APIError, CompletionRequest, status_of
from ingress.options import IngressOptions
from ingress.prompt_logprobs import echoed_logprobs
from ingress.request_bounds import check_range
from ingress.request_timing import IngressStamps
from ingress.request_validation import GenerationRequest, validate_completion
from ingress.token_text import TokenTexts

MAX_PROMPTS = 64
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class CompletionPlan:
    parts: list[GenerationRequest]  # one per prompt, each generating best_of samples
    n: int
    best_of: int
    echo: list[str] | None  # each prompt's text, when echoed
    logprobs: int | None  # what the client asked for (best_of ranks by the sampled tokens' logprobs)
    stream: bool
    include_usage: bool

    @property
    def single(self) -> bool:
        """Served as one plain generation."""
        return len(self.parts) == 1 and self.best_of == self.n and self.echo is None


def plan_completion(req: CompletionRequest, info: ModelInfo, limits: IngressOptions) -> CompletionPlan:
    prompts = _prompts(req.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    check_range("n", req.n, 1, limits.max_n)
    best_of = req.best_of if req.best_of is not None else req.n
    check_range("best_of", best_of, 1, limits.max_n)
    if best_of < req.n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({req.n})", param="best_of")
    if req.stream and best_of > req.n:
        raise APIError(400, "best_of > n cannot stream: the best are known only at the end", param="best_of")
    echo_logprobs = req.echo and req.logprobs is not None
    if echo_logprobs and req.stream:
        raise APIError(
            400,
            "echo with logprobs is answered without streaming (the prompt's logprobs lead the lists)",
            param="echo",
            code="unsupported_parameter",
        )
    parts = []
    for prompt in prompts:
        part = validate_completion(req.model_copy(update={"prompt": prompt, "n": best_of}), info, limits)
        if best_of > req.n and part.logprobs is None:  # rank by the sampled tokens' logprobs
            part.params = dataclasses.replace(part.params, logprobs=0)
            part.logprobs = 0
        if echo_logprobs:  # the workers compute the prompt's logprobs too
            k = max(req.logprobs, part.prompt_logprobs or 0)
            part.params = dataclasses.replace(part.params, prompt_logprobs=k)
        parts.append(part)
    # A token-id prompt echoes as its text, special tokens skipped as in the output (and as with logprobs).
    echo = (
        [p if isinstance(p, str) else info.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        if req.echo
        else None
    )
    return CompletionPlan(parts, req.n, best_of, echo, req.logprobs, req.stream, parts[0].include_usage)


def _prompts(prompt) -> list:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


async def serve_plan(serving, plan: CompletionPlan, rid: str, stamps: IngressStamps):
    """The joined answer: a dict, or an async iterator of SSE lines when streaming. ``serving``: the
    ``OpenAIServing`` (its admission, router, metrics and response shapes). The request takes
    one admission slot; its prompts' generations run together. As with one prompt, a stream starts
    only once every prompt produced its first output (or the request failed with its own status)."""
    slot = await serving.admit()
    gens = [
        Generation(
            f"{rid}-{i}",
            part,
            serving.info.tokenizer,
            serving.metrics,
            serving.texts,
            stamps=IngressStamps(stamps.arrived),
        )
        for i, part in enumerate(plan.parts)
    ]
    merged = _Merged([g.events(serving.router, serving.options.request_timeout_s) for g in gens])
    try:
        first = await merged.first_of_each()
        if plan.stream:
            return _joined_stream(serving, plan, gens, merged, first, slot, rid)
        logprobs = [{j: [] for j in range(plan.best_of)} for _ in gens]
        for i, deltas in first:
            _collect(logprobs[i], deltas)
        while (item := await merged.next()) is not None:
            _collect(logprobs[item[0]], item[1])
        answers = [
            serving._full_response(g.request_id, part, g, lp)
            for g, part, lp in zip(gens, plan.parts, logprobs)
        ]
        leads = None
        if plan.echo is not None and plan.logprobs is not None:
            texts = serving.texts or TokenTexts(serving.info.tokenizer)
            leads = [
                _PromptLead(g.prompt_logprobs or [], part.prompt_ids, plan.logprobs, texts)
                for g, part in zip(gens, plan.parts)
            ]
        serving.metrics.count("success")
        await _release(merged, slot)
        return _joined(plan, answers, rid, plan.parts[0].params.lora or serving.info.name, leads)
    except BaseException as exc:
        serving.metrics.count(status_of(exc))
        await _release(merged, slot)
        raise


class _PromptLead:
    """echo with logprobs: the prompt's tokens lead a choice's logprobs lists (as OpenAI answers) and
    its decoded text leads the text, so ``text_offset`` indexes the whole text."""

    def __init__(self, entries, prompt: list[int], k: int, texts: TokenTexts) -> None:
        self.lists, self.chars = echoed_logprobs(entries, prompt, k, texts)
        self.text = texts.tokenizer.decode(prompt, skip_special_tokens=True)[: self.chars]

    def apply(self, choice: dict) -> None:
        lp, lead = choice["logprobs"], self.lists
        choice["text"] = self.text + choice["text"]
        choice["logprobs"] = {
            "tokens": lead["tokens"] + lp["tokens"],
            "token_logprobs": lead["token_logprobs"] + lp["token_logprobs"],
            "top_logprobs": lead["top_logprobs"] + lp["top_logprobs"],
            "text_offset": lead["text_offset"] + [o + self.chars for o in lp["text_offset"]],
        }


def _collect(choices: dict[int, list], deltas: list) -> None:
    for d in deltas:
        choices[d.index].extend(d.logprobs)


async def _release(merged: _Merged, slot) -> None:
    await merged.close()
    await slot.__aexit__(None, None, None)


class _Merged:
    """Several generations' event streams read as one: (prompt index, deltas) in arrival order; a
    prompt's failure is raised to the reader; ``close`` stops and closes them all."""

    def __init__(self, streams: list[AsyncIterator]) -> None:
        self.streams = streams
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open = len(streams)
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator) -> None:
        try:
            async for deltas in stream:
                await self.queue.put((i, deltas, None))
            await self.queue.put((i, None, None))
        except Exception as exc:
            await self.queue.put((i, None, exc))

    async def next(self) -> tuple[int, list] | None:
        while self.open:
            i, deltas, exc = await self.queue.get()
            if exc is not None:
                raise exc
            if deltas is None:
                self.open -= 1
                continue
            return i, deltas
        return None

    async def first_of_each(self) -> list[tuple[int, list]]:
        """Everything read until each prompt produced something (or ended)."""
        got: list[tuple[int, list]] = []
        seen: set[int] = set()
        while len(seen) < len(self.streams) and (item := await self.next()) is not None:
            got.append(item)
            seen.add(item[0])
        return got

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.streams:
            await s.aclose()


def _joined(plan: CompletionPlan, answers: list[dict], rid: str, model: str, leads=None) -> dict:
    choices, usage = [], Usage(0)
    for i, answer in enumerate(answers):
        cs = answer["choices"]
        if plan.best_of > plan.n:
            cs = sorted(cs, key=_mean_logprob, reverse=True)[: plan.n]
        for j, c in enumerate(cs):
            c["index"] = i * plan.n + j
            if leads is not None:
                leads[i].apply(c)
            elif plan.echo is not None:
                c["text"] = plan.echo[i] + c["text"]
            if plan.logprobs is None:
                c["logprobs"] = None
            choices.append(c)
        _add_usage(usage, answer["usage"])
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage.to_dict(),
    }


def _mean_logprob(choice: dict) -> float:
    lps = choice["logprobs"]["token_logprobs"]
    return sum(lps) / len(lps) if lps else float("-inf")


async def _joined_stream(serving, plan, gens, merged: _Merged, first, slot, rid: str):
    model = plan.parts[0].params.lora or serving.info.name
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    tail = {"usage": None} if plan.include_usage else {}  # every chunk's but the usage one (OpenAI)
    status = "error"
    try:
        if plan.echo is not None:
            for i, text in enumerate(plan.echo):
                echoed = [
                    {"index": i * plan.n + j, "text": text, "logprobs": None, "finish_reason": None}
                    for j in range(plan.n)
                ]
                yield _sse({**head, "choices": echoed, **tail})
        pending = list(first)
        while True:
            item = pending.pop(0) if pending else await merged.next()
            if item is None:
                break
            i, deltas = item
            choices = [serving._stream_choice(plan.parts[i], d) for d in deltas]
            for c in choices:
                c["index"] += i * plan.n
            yield _sse({**head, "choices": choices, **tail})
        if plan.include_usage:
            usage = Usage(0)
            for g in gens:
                _add_usage(usage, g.usage.to_dict())
            yield _sse({**head, "choices": [], "usage": usage.to_dict()})
        status = "success"
    except APIError as exc:
        yield _sse(exc.body())
    except BaseException as exc:
        status = status_of(exc)
        raise
    finally:
        serving.metrics.count(status)
        await _release(merged, slot)
    yield _DONE


def _add_usage(total: Usage, u: dict) -> None:
    total.prompt_tokens += u.get("prompt_tokens", 0)
    total.completion_tokens += u.get("completion_tokens", 0)
    total.cached_tokens += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
