"""Every numeric request field's range, checked at the edge with the field named.

The bounds are what the rest of the system can carry: the wire types of ``proto/pdserve.proto``
(``priority`` and ``top_k`` are int32, ``seed`` uint64 but the engine's seeds are below 2**63,
sampling floats are float32) and the engine's own ranges. A value outside them is a 400 naming
the field (OpenAI's ``param``) before anything else happens; nothing overflows on the way to a
worker. Non-finite numbers never get here: the request models refuse NaN and infinities.
"""

from __future__ import annotations

from ingress.openai_protocol import APIError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SEED_MAX = 2**63 - 1  # SamplingParams' bound (the proto's uint64 holds more)
# Beyond this the distribution is uniform to float32 precision for any real logits; and the value
# must stay finite as a float32 on the wire (1e308 would arrive as inf).
MAX_TEMPERATURE = 1000.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: streaming holds back up to this much text
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_REPETITION_PENALTY = 1000.0  # stays a finite float32 on the wire
# NOTE: a positive top_p below every token's probability keeps only the top token, whatever its
# value; float32 would turn one below ~1e-45 into 0, which the wire reads as "off". Raising such a
# value to this floor (under 1 / any real vocabulary) keeps its meaning.
TOP_P_FLOOR = 1e-9
# Characters per token that a prompt of max_model_len tokens can hardly exceed: prompt text longer
# than this many times the context is refused before it is tokenized.
PROMPT_CHARS_PER_TOKEN = 32


def check_range(name: str, value, low, high, *, what: str | None = None) -> None:
    if value is not None and not low <= value <= high:
        raise APIError(400, f"{name} must be in [{what or low}, {high}], got {value}", param=name)


def check_sampling(req, max_n: int) -> None:
    """The sampling fields both endpoints share (``openai_protocol._SamplingFields``)."""
    check_range("n", req.n, 1, max_n)
    check_range("temperature", req.temperature, 0, MAX_TEMPERATURE)
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    check_range("min_p", req.min_p, 0, 1)
    check_range("top_k", req.top_k, -1, INT32_MAX, what="-1 (off)")
    check_range("seed", req.seed, 0, SEED_MAX)
    check_range("priority", req.priority, INT32_MIN, INT32_MAX)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise APIError(
            400,
            f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
    ids = req.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"stop_token_ids takes up to {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
    check_range("presence_penalty", req.presence_penalty, -2, 2)
    check_range("frequency_penalty", req.frequency_penalty, -2, 2)
    if req.repetition_penalty is not None and not 0 < req.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise APIError(
            400,
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {req.repetition_penalty}",
            param="repetition_penalty",
        )
    check_range("min_tokens", req.min_tokens, 0, INT32_MAX)
    check_logit_bias(req.logit_bias)
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS or any(not 0 < len(w.strip()) <= MAX_BAD_WORD_CHARS for w in words):
        raise APIError(
            400,
            f"bad_words takes up to {MAX_BAD_WORDS} strings of 1 to {MAX_BAD_WORD_CHARS} characters "
            "(not only spaces)",
            param="bad_words",
        )


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int | None = None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings -> [-100, 100]) as the engine's {id: bias};
    ``vocab_size`` bounds the ids once the model is known."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise APIError(400, f"logit_bias takes up to {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f" in [0, {vocab_size})" if vocab_size is not None else " (a non-negative integer)"
            raise APIError(400, f"logit_bias key {key!r} must be a token id{where}", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(
                400, f"logit_bias values must be in [-100, 100], got {value} for {key!r}", param="logit_bias"
            )
        out[token] = float(value)
    return out


def check_max_tokens(name: str, value: int | None) -> None:
    """A requested completion length: at least 1 (the context bounds it from above)."""
    if value is not None and value < 1:
        raise APIError(400, f"{name} must be >= 1, got {value}", param=name)


def prompt_chars_limit(configured: int | None, max_model_len: int) -> int:
    return configured if configured is not None else PROMPT_CHARS_PER_TOKEN * max_model_len


def check_prompt_chars(chars: int, limit: int, max_model_len: int, param: str) -> None:
    """Refuse text that cannot fit the context before spending time tokenizing it."""
    if chars > limit:
        raise APIError(
            400,
            f"{param} too long: {chars} characters of text, over the {limit} accepted (this model's "
            f"maximum context length is {max_model_len} tokens). Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
