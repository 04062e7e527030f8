"""Per-request sampling parameters, validated when constructed."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from engine.json_schema_support import check_schema

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily, as vLLM's (its _SAMPLING_EPS)
MAX_N = 64
MAX_TOP_K = 2**31 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty / frequency_penalty


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must be: ``json_schema`` (``value``: the schema as JSON text), ``json_object``
    (any JSON object), ``regex``, ``choice`` (``value``: a JSON list of the allowed strings) or
    ``grammar`` (EBNF, xgrammar's dialect)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError("structured output value must be a string")
        if self.kind in ("json_schema", "choice"):
            try:
                parsed = json.loads(self.value)
            except (ValueError, RecursionError) as exc:  # (nested past the parser's recursion limit)
                raise ValueError(f"structured output {self.kind} is not valid JSON: {exc}") from None
            if self.kind == "json_schema" and not isinstance(parsed, dict):
                raise ValueError("a JSON schema must be a JSON object")
            if self.kind == "json_schema":
                check_schema(parsed)  # keywords generation cannot be held to: refused, named
            if self.kind == "choice" and not (
                isinstance(parsed, list) and parsed and all(isinstance(c, str) and c for c in parsed)
            ):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        elif self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"structured output {self.kind} must not be empty")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request.

    temperature == 0 (or under 1e-5) means greedy. ``top_k`` -1 or 0 disables top-k; ``top_p`` == 1 and ``min_p`` == 0
    disable theirs. ``seed`` makes sampling a pure function of (seed, sample index, position), so
    the same request samples the same tokens on any engine. ``logprobs`` = k returns the sampled
    token's logprob and the top-k alternatives (k = 0: the sampled token's only).
    ``n`` parallel samples share the prompt's KV blocks copy-on-write.

    Logits processing, applied in this order before temperature and the filters (as vLLM does):
    ``bad_words_token_ids`` (each a token sequence: its last token is banned where the output so far
    ends with the rest), ``min_tokens`` (EOS and ``stop_token_ids`` banned until that many tokens
    were generated), ``logit_bias`` (token id -> value added to its logit), then
    ``repetition_penalty`` (on tokens of the prompt or output: positive logits divided, negative
    multiplied), ``frequency_penalty`` (times each token's count in the output) and
    ``presence_penalty`` (once for each token present in the output), both subtracted. Greedy
    decoding takes the argmax of the processed logits; returned logprobs are the model's own.
    ``bad_words`` are strings for whoever holds the tokenizer (``LLM``, the HTTP ingress) to turn
    into ``bad_words_token_ids``; the engine itself reads only the ids.

    ``prompt_logprobs`` = k: the logprob of every prompt token after the first (given the ones
    before it) and the top-k alternatives at each position; the prompt is then computed in full (no
    prefix-cache hit), and the values come with the request's first output.

    ``structured``: a grammar the output must follow (``StructuredOutput``); the request then ends on
    EOS once the output is complete, so ``ignore_eos`` cannot be set with it.

    ``prior_output_tokens``: how many of the prompt's last tokens this request generated earlier (a
    generation continued from its own output, a request resumed on another worker): penalties and
    bad words count them as output. ``max_tokens`` and ``min_tokens`` stay budgets of what is left.

    ``speculative`` = False: decode this request one token per step even when the engine speculates
    (requests with logits processing or a grammar never speculate).

    ``lora``: the name of the LoRA adapter to run the request with (None: the base model); the engine
    refuses a name it does not serve (``engine.core_lora``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: what the context (and the KV pool) leaves the prompt
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    prior_output_tokens: int = 0
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    speculative: bool = True
    lora: str | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be an adapter's name, got {self.lora!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids or []]
        self._validate()
        self._validate_processing()
        if 0 < self.temperature < GREEDY_BELOW:  # logits / temperature would overflow to inf (NaN)
            self.temperature = 0.0

    def _validate(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if not -1 <= self.top_k <= MAX_TOP_K:  # past the vocabulary it keeps every token; packed as int64
            raise ValueError(
                f"top_k must be -1 or 0 (off) or a positive integer, at most {MAX_TOP_K}, got {self.top_k}"
            )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entries", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
                )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            _check_int("logit_bias keys", tok)
            if tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok}")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        _check_int("prior_output_tokens", self.prior_output_tokens)
        if self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must be non-empty strings, got {w!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError("structured must be a StructuredOutput")
            if self.ignore_eos:
                raise ValueError(
                    "structured output ends on EOS once complete: ignore_eos cannot be set with it"
                )
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be set with structured output: the grammar decides the length"
                )
        for ids in self.bad_words_token_ids:
            if not ids:
                raise ValueError("bad_words_token_ids entries must be non-empty token sequences")
            for t in ids:
                _check_int("bad_words_token_ids entries", t)
                if t < 0:
                    raise ValueError(f"bad_words_token_ids must be >= 0, got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def continued(self, tokens: int) -> SamplingParams:
        """These params for the same request once ``tokens`` of its output joined its prompt."""
        return dataclasses.replace(
            self,
            max_tokens=None if self.max_tokens is None else self.max_tokens - tokens,
            min_tokens=max(0, self.min_tokens - tokens),
            prior_output_tokens=self.prior_output_tokens + tokens,
            prompt_logprobs=None,  # sent with the first output already
        )

    @property
    def penalized(self) -> bool:
        """Whether any penalty reads the sequence's history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature and filters."""
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.bad_words_token_ids)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, x: object) -> None:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"{name} must be an integer, got {x!r}")
