"""OpenAI-compatible request bodies and the error schema.

The models are strict (``extra="forbid"``, no type coercion): a field we do not implement is
refused with a 400 naming it rather than silently ignored, and ``"max_tokens": "5"`` is a type
error, as with OpenAI. Ranges that depend on the deployment (n, logprobs, the context length, the
vocabulary) are checked by ``ingress.request_validation`` after parsing.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from engine.chat_format import decoded_arguments

Number = StrictInt | StrictFloat


class APIError(Exception):
    """An error answered with OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        499: "cancelled",
        500: "server_error",
        503: "service_unavailable",
        504: "timeout_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(
                    self.status, "server_error" if self.status >= 500 else "invalid_request_error"
                ),
                "param": self.param,
                "code": self.code,
            }
        }


_NULL_DEFAULTED: dict[type, frozenset[str]] = {}  # per request model: its non-nullable optional fields


class _Request(BaseModel):
    # NaN and infinities (json accepts NaN, Infinity and 1e999) are refused with the field named.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``null`` for an optional field that takes no ``None`` of its own is its default, as
        OpenAI's API (every optional field is nullable there) and vLLM take it: clients and SDKs
        send ``"n": null``, ``"stream": null``. A field whose ``None`` means something keeps it
        (``max_tokens``: up to the context), and a required field's ``null`` is refused, named."""
        if isinstance(data, dict) and None in data.values():
            defaulted = _NULL_DEFAULTED.get(cls)
            if defaulted is None:
                defaulted = _NULL_DEFAULTED[cls] = frozenset(
                    k
                    for k, f in cls.model_fields.items()
                    if not f.is_required() and type(None) not in get_args(f.annotation)
                )
            return {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _SamplingFields(_Request):
    model: StrictStr
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    priority: StrictInt = 0
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None  # token id (as a string, as OpenAI's) -> bias
    # vLLM's extra sampling fields.
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[StrictStr] | None = None
    speculative: StrictBool = True  # pdserve's: false decodes one token per step on a speculating engine
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: per prompt token, its logprob and the top-k
    suffix: StrictStr | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool's answer: the call it answers

    def for_template(self) -> dict:
        """The message as chat templates take it (``engine.chat_format``, as ``LLM.chat`` gives it):
        an earlier call's ``arguments`` decoded into the object they encode."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                msg[key] = value
        if self.tool_calls:
            msg["tool_calls"] = [decoded_arguments(c) for c in self.tool_calls]
        return msg

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


def status_of(exc: BaseException) -> str:
    """How a request that raised ``exc`` is counted in the requests metric."""
    if isinstance(exc, APIError):
        return "client_error" if exc.status < 500 and exc.status != 429 else "error"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return "error"


def error_from_validation(exc) -> APIError:
    """A pydantic ValidationError as a 400 naming the first offending field (its value shown short:
    a multi-megabyte input is not echoed back)."""
    errors = exc.errors()
    first = errors[0]
    # Union members add a type tag to the location ("temperature.float"): name the field only.
    loc = _loc(first)
    kind = first.get("type", "")
    # A union reports each member; a non-finite float fails the int member first, so look further.
    finite = next((e for e in errors if e.get("type") == "finite_number" and _loc(e) == loc), None)
    # A list the field accepts, whose items are wrong (``prompt: [1.5]``, an image content part):
    # the item is what to name, not the list's other forms.
    item = next((e for e in errors if _loc(e).startswith(f"{loc}.")), None)
    if finite is not None:
        msg = f"invalid value for {loc!r}: must be a finite number, got {finite.get('input')}"
    elif item is not None and _member_kinds(errors, loc):
        loc, kind = _loc(item), item.get("type", "")
        if kinds := _member_kinds(errors, loc):
            msg = f"invalid value for {loc!r}: must be {' or '.join(kinds)}, got {_shown(item.get('input'))}"
        elif kind == "literal_error" and loc.endswith(".type"):  # an image part, an unknown tool type
            kind, expected = "extra_forbidden", (item.get("ctx") or {}).get("expected", "?")
            msg = f"unsupported {loc!r}: {_shown(item.get('input'))}; supported: {expected}"
        else:
            msg = f"invalid value for {loc!r}: {item.get('msg', 'invalid')}, got {_shown(item.get('input'))}"
    elif kinds := _member_kinds(errors, loc):  # the value's type is wrong (for every member of a union)
        msg = f"invalid value for {loc!r}: must be {' or '.join(kinds)}, got {_shown(first.get('input'))}"
    elif kind == "extra_forbidden":
        msg = f"unsupported field {loc!r}"
    elif kind == "missing":
        msg = f"missing required field {loc!r}"
    else:
        msg = f"invalid value for {loc!r}: {first.get('msg', 'invalid')}"
    code = {"missing": "missing_field", "extra_forbidden": "unsupported_parameter"}.get(kind, "invalid_value")
    return APIError(400, msg, param=loc or None, code=code)


def _shown(value: object, limit: int = 100) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "none_required": "null",
}


def _member_kinds(errors: list[dict], loc: str) -> list[str]:
    """What the field at ``loc`` accepts, from its (union members') type errors ("an integer" and "a
    number" say "a number"); empty unless every error there is a type error."""
    here = [e.get("type", "") for e in errors if _loc(e) == loc]
    if not here or any(t not in _KINDS for t in here):
        return []
    kinds = list(dict.fromkeys(_KINDS[t] for t in here))
    if "an integer" in kinds and "a number" in kinds:
        kinds.remove("an integer")
    return kinds


def _loc(error: dict) -> str:
    return ".".join(str(p) for p in error.get("loc", ()) if not _is_type_tag(p))


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


_TYPE_TAGS = {"int", "float", "str", "bool", "none", "list", "dict", "TextPart"}
