"""vLLM's utility endpoints: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

They answer from the ingress's own tokenizer and never touch the router or a worker. Bodies are
validated as strictly as the OpenAI endpoints' (unknown fields refused, the model checked, the
prompt's characters bounded before it is tokenized), and a body over ``INLINE_BODY_BYTES`` is
parsed and (de)tokenized off the event loop, as ``OpenAIServing`` does for completions.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import Field, StrictBool, StrictInt, StrictStr

from ingress.model_info import ModelInfo
from ingress.openai_protocol import APIError, ChatMessage, _Request
from ingress.openai_serving import INLINE_BODY_BYTES, OpenAIServing
from ingress.options import IngressOptions
from ingress.request_bounds import check_prompt_chars, prompt_chars_limit
from ingress.request_validation import _check_model, parse_body

T = TypeVar("T")


class TokenizeRequest(_Request):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest`` (``messages``)."""

    model: StrictStr | None = Field(default=None, description="the served model; omitted: that one")
    prompt: StrictStr | None = Field(default=None, description="the text to tokenize (or give messages)")
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, description="a chat, rendered by the model's chat template"
    )
    add_generation_prompt: StrictBool | None = Field(
        default=None, description="chat form only (default true): end with the assistant's turn"
    )
    add_special_tokens: StrictBool | None = Field(
        default=None, description="default: true for a prompt, false for messages (the template has them)"
    )
    return_token_strs: StrictBool = Field(default=False, description="also return each token's string")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="chat form only: tools as /v1/chat/completions passes them to the template"
    )


class DetokenizeRequest(_Request):
    model: StrictStr | None = Field(default=None, description="the served model; omitted: that one")
    tokens: list[StrictInt]


async def tokenize(serving: OpenAIServing, body: bytes) -> dict:
    return await _offloaded(serving, body, lambda: _tokenize(body, serving.info, serving.options))


async def detokenize(serving: OpenAIServing, body: bytes) -> dict:
    return await _offloaded(serving, body, lambda: _detokenize(body, serving.info))


def version() -> dict:
    return {"version": importlib.metadata.version("pdserve")}


async def _offloaded(serving: OpenAIServing, body: bytes, work: Callable[[], T]) -> T:
    """``work`` (parse + tokenizer calls) inline for a small body, on a thread for a large one."""
    if serving.draining:
        raise APIError(503, "server is shutting down", code="draining")
    if len(body) <= INLINE_BODY_BYTES:
        return work()
    # NOTE: not OpenAIServing's tokenizer pool (private); the tokenizer is only read, as there.
    return await asyncio.to_thread(work)


def _tokenize(body: bytes, info: ModelInfo, limits: IngressOptions) -> dict:
    req = parse_body(body, TokenizeRequest)
    if req.model is not None:
        _check_model(req.model, info)
    if req.prompt is not None and req.messages is not None:
        raise APIError(400, "give prompt or messages, not both", param="messages")
    limit = prompt_chars_limit(limits.max_prompt_chars, info.max_model_len)
    tok = info.tokenizer
    if req.messages is None:
        if req.prompt is None:
            raise APIError(400, "missing required field 'prompt'", param="prompt", code="missing_field")
        for name in ("add_generation_prompt", "tools"):
            if getattr(req, name) is not None:
                raise APIError(
                    400, f"{name} applies to messages only", param=name, code="unsupported_parameter"
                )
        check_prompt_chars(len(req.prompt), limit, info.max_model_len, "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tok.encode(req.prompt, add_special_tokens=special))
    else:
        text = _render_chat(req, info, limit)
        ids = list(tok.encode(text, add_special_tokens=bool(req.add_special_tokens)))
    return {
        "count": len(ids),
        "max_model_len": info.max_model_len,
        "tokens": ids,
        "token_strs": list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None,
    }


def _render_chat(req: TokenizeRequest, info: ModelInfo, limit: int) -> str:
    """The chat template's text, rendered as ``request_validation.validate_chat`` renders it."""
    tok = info.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise APIError(400, f"model {info.name} has no chat template: send a prompt", code="no_chat_template")
    messages = [m.for_template() for m in req.messages or []]
    check_prompt_chars(sum(len(m["content"]) for m in messages), limit, info.max_model_len, "messages")
    generation = True if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        return tok.apply_chat_template(
            messages, tools=req.tools or None, add_generation_prompt=generation, tokenize=False
        )
    except Exception as exc:  # a template's own error (e.g. roles must alternate) is the client's
        raise APIError(400, f"chat template failed: {exc}", param="messages") from exc


def _detokenize(body: bytes, info: ModelInfo) -> dict:
    req = parse_body(body, DetokenizeRequest)
    if req.model is not None:
        _check_model(req.model, info)
    bad = next((t for t in req.tokens if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} is outside the vocabulary [0, {info.vocab_size})",
            param="tokens",
            code="invalid_token_id",
        )
    return {"prompt": info.tokenizer.decode(req.tokens)}
