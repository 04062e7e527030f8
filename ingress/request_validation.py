"""OpenAI request bodies -> token ids and ``SamplingParams``, or an ``APIError`` naming the field.

Runs entirely in the ingress: every check that can fail does so here, before the router or any
worker sees the request (range checks, the model name, the vocabulary, the context length).
Cheap checks come first and the prompt's length in characters is bounded before it is tokenized,
so an oversized prompt costs almost nothing. These functions block (templates, tokenization): the
serving layer runs large bodies through them off the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from pydantic import ValidationError

from engine.bad_words import bad_words_token_ids
from engine.sampling_params import SamplingParams
from ingress.model_info import ModelInfo
from ingress.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_from_validation,
)
from ingress.options import IngressOptions
from ingress.request_bounds import (
    TOP_P_FLOOR,
    check_logit_bias,
    check_max_tokens,
    check_prompt_chars,
    check_range,
    check_sampling,
    prompt_chars_limit,
)
from ingress.structured_request import structured_output, structured_param
from ingress.tool_calls import ToolPlan, plan_tools


@dataclass(slots=True)
class GenerationRequest:
    """A validated request, ready for the router."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    priority: int
    logprobs: int | None  # alternatives per token; None: no logprobs in the response
    tools: ToolPlan | None = None  # chat with tools: how to read calls from the answer
    prompt_logprobs: int | None = None  # completions: return the prompt's logprobs (top-k)
    structured_param: str | None = None  # the field that asked for structured output


def parse_body(body: bytes, model_cls: type[CompletionRequest] | type[ChatCompletionRequest]):
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # also: integers over 4300 digits, deep nesting
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    bad = _lone_surrogate_at(obj) if _may_hold_surrogates(body) else None
    if bad is not None:  # JSON allows "\ud800"; no tokenizer (or UTF-8) can take it
        raise APIError(400, f"{bad} contains a lone UTF-16 surrogate: not valid Unicode text", param=bad)
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        raise error_from_validation(exc) from exc


# A JSON escape of a UTF-16 surrogate (U+D800-U+DFFF): ``\ud800`` .. ``\udfff``.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(body: bytes) -> bool:
    """False when no string of the parsed body can hold a surrogate: an ASCII body (``json.loads``
    decodes bytes with ``surrogatepass``, so non-ASCII bytes may be one) with no surrogate escape.
    Two scans in C instead of a walk of the parsed body in Python (a prompt of token ids is a
    list of thousands of numbers)."""
    return not body.isascii() or _SURROGATE_ESCAPE.search(body) is not None


def _lone_surrogate_at(value, path: str = "") -> str | None:
    """The dotted path of the first string (value or key) in ``value`` holding a lone surrogate."""
    if isinstance(value, str):
        return None if value.isascii() or not _has_surrogate(value) else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if _has_surrogate(key):
                return path or "body"
            found = _lone_surrogate_at(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, (str, dict, list)):  # a number: nothing to look at
                continue
            found = _lone_surrogate_at(item, f"{path}.{i}")
            if found is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_stream_options(req) -> None:
    """OpenAI refuses ``stream_options`` on a request that does not stream."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def validate_completion(req: CompletionRequest, info: ModelInfo, limits: IngressOptions) -> GenerationRequest:
    """One prompt (a string, a token-id list, or a one-element list of either) with ``n`` samples;
    ``ingress.completion_batch`` splits lists of prompts, ``best_of`` and ``echo`` into such requests."""
    _check_model(req.model, info)
    _check_stream_options(req)
    if req.suffix:
        raise APIError(
            400,
            "suffix is not supported (no fill-in-the-middle for this model)",
            param="suffix",
            code="unsupported_parameter",
        )
    check_sampling(req, limits.max_n)
    logprobs = _bounded("logprobs", req.logprobs, limits.max_logprobs)
    check_max_tokens("max_tokens", req.max_tokens)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "one prompt expected here", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
        limit = prompt_chars_limit(limits.max_prompt_chars, info.max_model_len)
        check_prompt_chars(len(prompt), limit, info.max_model_len, "prompt")
        ids = list(info.tokenizer.encode(prompt))
    else:
        ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt must contain at least one token", param="prompt", code="empty_prompt")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"prompt token id {bad} is outside the vocabulary [0, {info.vocab_size})",
            param="prompt",
            code="invalid_token_id",
        )
    g = _finish(req, ids, req.max_tokens, "max_tokens", logprobs, info, chat=False)
    g.prompt_logprobs = _bounded("prompt_logprobs", req.prompt_logprobs, limits.max_logprobs)
    if g.prompt_logprobs is not None:
        g.params = dataclasses.replace(g.params, prompt_logprobs=g.prompt_logprobs)
    return g


def validate_chat(req: ChatCompletionRequest, info: ModelInfo, limits: IngressOptions) -> GenerationRequest:
    _check_model(req.model, info)
    _check_stream_options(req)
    for i, m in enumerate(req.messages):  # only an assistant's tool calls may stand without content
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(
                400,
                f"messages[{i}] ({m.role}) needs a content",
                param=f"messages.{i}.content",
                code="missing_field",
            )
        if m.role == "tool" and not m.tool_call_id:  # OpenAI's: a tool's answer names the call it answers
            raise APIError(
                400,
                f"messages[{i}] (tool) needs a tool_call_id: the id of the call it answers",
                param=f"messages.{i}.tool_call_id",
                code="missing_field",
            )
    tools, tool_plan, tool_grammar = plan_tools(req)
    check_sampling(req, limits.max_n)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(400, "give max_completion_tokens or max_tokens, not both", param="max_tokens")
    check_max_tokens("max_tokens", req.max_tokens)
    check_max_tokens("max_completion_tokens", req.max_completion_tokens)
    top = _bounded("top_logprobs", req.top_logprobs, limits.max_logprobs)
    if top is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    tok = info.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise APIError(
            400, f"model {info.name} has no chat template: use /v1/completions", code="no_chat_template"
        )
    messages = [m.for_template() for m in req.messages]
    limit = prompt_chars_limit(limits.max_prompt_chars, info.max_model_len)
    check_prompt_chars(sum(len(m["content"]) for m in messages), limit, info.max_model_len, "messages")
    try:
        text = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=req.add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # a template's own error (e.g. roles must alternate) is the client's
        raise APIError(400, f"chat template failed: {exc}", param="messages") from exc
    ids = list(tok.encode(text, add_special_tokens=False))
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages", code="empty_prompt")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (top or 0) if req.logprobs else None
    g = _finish(req, ids, max_tokens, param, logprobs, info, chat=True, grammar=tool_grammar)
    g.tools = tool_plan
    return g


def _finish(
    req, ids, max_tokens, max_param, logprobs, info, *, chat: bool, grammar=None
) -> GenerationRequest:
    """The context check and the engine's parameters; the fields' own ranges are checked already."""
    prompt_param = "messages" if chat else "prompt"
    room = info.max_model_len - len(ids)
    if room < 1:  # the prompt alone fills the context, whatever max_tokens says
        raise APIError(
            400,
            f"This model's maximum context length is {info.max_model_len} tokens. However, your "
            f"{prompt_param} resulted in {len(ids)} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:  # chat default: whatever the context leaves
        max_tokens = room
    if len(ids) + max_tokens > info.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} for the "
            "completion). Please reduce the prompt or the completion length.",
            param=max_param,
            code="context_length_exceeded",
        )
    bad = next((t for t in req.stop_token_ids or [] if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"stop token id {bad} is outside the vocabulary [0, {info.vocab_size})",
            param="stop_token_ids",
        )
    top_k = req.top_k if req.top_k is not None else 0
    top_p = 1.0 if req.top_p is None else max(req.top_p, TOP_P_FLOOR)
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise APIError(
            400, f"min_tokens ({min_tokens}) must not exceed {max_param} ({max_tokens})", param="min_tokens"
        )
    bias = check_logit_bias(req.logit_bias, info.vocab_size)
    bad_words = bad_words_token_ids(info.tokenizer, req.bad_words) if req.bad_words else []
    structured = structured_output(req)
    if (structured is not None or grammar is not None) and min_tokens:
        raise APIError(
            400, "min_tokens cannot be set with structured output or a required tool call", param="min_tokens"
        )
    if grammar is not None:  # tool_choice "required" or a named function
        if structured is not None:
            raise APIError(
                400, "tool_choice cannot be combined with a structured output", param="tool_choice"
            )
        if req.ignore_eos:
            raise APIError(
                400, "tool_choice with calls ends on EOS: ignore_eos cannot be set", param="ignore_eos"
            )
        structured = grammar
    try:
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            min_tokens=min_tokens,
            bad_words_token_ids=bad_words,
            structured=structured,
            speculative=req.speculative,
            lora=_check_model(req.model, info),
        )
    except ValueError as exc:  # the engine's own bounds, should they ever be narrower than ours
        raise APIError(400, str(exc), param=_param_of(str(exc))) from exc
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    g = GenerationRequest(ids, params, req.stream, include_usage, chat, req.priority, logprobs)
    if params.structured is not None:  # the field a worker's refusal to compile the grammar names
        g.structured_param = "tools" if grammar is not None else structured_param(req)
    return g


def _check_model(model: str, info: ModelInfo) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model); 404 for a model not served."""
    if model == info.name:
        return None
    if model in info.adapters:
        return model
    adapters = f" and the LoRA adapters {', '.join(map(repr, info.adapters))}" if info.adapters.names else ""
    raise APIError(
        404,
        f"The model {model!r} does not exist; this server serves {info.name!r}{adapters}",
        param="model",
        code="model_not_found",
    )


def _bounded(name: str, value: int | None, bound: int) -> int | None:
    check_range(name, value, 0, bound)
    return value


def _param_of(message: str) -> str | None:
    """SamplingParams' messages start with the field name ("top_p must be in (0, 1], ...")."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None
