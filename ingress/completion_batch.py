"""Completions with several prompts, ``best_of`` or ``echo``: one request split into the single-prompt
generations the rest of the ingress serves, and their answers joined in OpenAI's shape.

Choice ``i * n + j`` is sample j of prompt i, as OpenAI indexes them. ``best_of`` = k > n generates k
samples per prompt (the engine computes the prompt once and forks the samples from it, sharing its KV
blocks copy-on-write) and returns the n with the highest mean token logprob, OpenAI's "best"; such a
request cannot stream (OpenAI's rule). ``echo`` puts each prompt's text before its choices' text (a
stream sends it as each choice's first chunk). ``usage`` adds up every generation, best_of's extra
samples included. Each prompt is a request of its own to the router and takes its own admission slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ingress.model_info import ModelInfo
from ingress.openai_protocol import APIError, CompletionRequest
from ingress.options import IngressOptions
from ingress.request_bounds import check_range
from ingress.request_timing import IngressStamps
from ingress.request_validation import GenerationRequest, validate_completion

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
    if req.echo and req.logprobs is not None:
        raise APIError(
            400,
            "echo with logprobs needs the prompt's logprobs, which pdserve does not compute",
            param="echo",
            code="unsupported_parameter",
        )
    parts = []
    for prompt in prompts:
        part = validate_completion(req.model_copy(update={"prompt": prompt, "n": best_of}), info, limits)
        if best_of > req.n and part.logprobs is None:  # rank by the sampled tokens' logprobs
            part.params = dataclasses.replace(part.params, logprobs=0)
            part.logprobs = 0
        parts.append(part)
    echo = [p if isinstance(p, str) else info.tokenizer.decode(p) for p in prompts] if req.echo else None
    return CompletionPlan(parts, req.n, best_of, echo, req.logprobs, req.stream, parts[0].include_usage)


def _prompts(prompt) -> list:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


Serve = Callable[[GenerationRequest, str, IngressStamps, bool], Awaitable]


async def serve_plan(serve: Serve, plan: CompletionPlan, rid: str, model: str, stamps: IngressStamps):
    """The joined answer: a dict, or an async iterator of SSE lines when streaming."""
    ids = [f"{rid}-{i}" for i in range(len(plan.parts))]
    async with asyncio.TaskGroup() as tg:  # the first failure cancels the other prompts
        tasks = [
            tg.create_task(serve(part, pid, IngressStamps(stamps.arrived), False))
            for part, pid in zip(plan.parts, ids)
        ]
    answers = [t.result() for t in tasks]
    if plan.stream:
        return _joined_stream(plan, answers, rid, model)
    return _joined(plan, answers, rid, model)


def _joined(plan: CompletionPlan, answers: list[dict], rid: str, model: str) -> dict:
    choices, usage = [], _Usage()
    for i, answer in enumerate(answers):
        cs = answer["choices"]
        if plan.best_of > plan.n:
            cs = sorted(cs, key=_mean_logprob, reverse=True)[: plan.n]
        for j, c in enumerate(cs):
            c["index"] = i * plan.n + j
            if plan.echo is not None:
                c["text"] = plan.echo[i] + c["text"]
            if plan.logprobs is None:
                c["logprobs"] = None
            choices.append(c)
        usage.add(answer["usage"])
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


async def _joined_stream(plan: CompletionPlan, streams: list[AsyncIterator[bytes]], rid: str, model: str):
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[bytes]) -> None:
        try:
            async for line in stream:
                await queue.put((i, line))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    usage, created, open_streams = _Usage(), int(time.time()), len(streams)
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    try:
        if plan.echo is not None:
            for i, text in enumerate(plan.echo):
                echoed = [
                    {"index": i * plan.n + j, "text": text, "logprobs": None, "finish_reason": None}
                    for j in range(plan.n)
                ]
                yield _sse({**head, "choices": echoed})
        while open_streams:
            i, line = await queue.get()
            if line is None:
                open_streams -= 1
                continue
            if line == _DONE:
                continue
            obj = json.loads(line[len(b"data: ") :])
            if "error" in obj:
                yield line
                continue
            if not obj["choices"]:  # a prompt's usage chunk: one for the request, at the end
                usage.add(obj.get("usage") or {})
                continue
            obj["id"] = rid
            for c in obj["choices"]:
                c["index"] += i * plan.n
            yield _sse(obj)
        if plan.include_usage:
            yield _sse({**head, "choices": [], "usage": usage.to_dict()})
        yield _DONE
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


class _Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, u: dict) -> None:
        self.prompt += u.get("prompt_tokens", 0)
        self.completion += u.get("completion_tokens", 0)
        self.cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
