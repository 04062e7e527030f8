"""Per-request sampling parameters, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 64


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request.

    temperature == 0 means greedy. ``top_k`` <= 0 disables top-k; ``top_p`` == 1 and ``min_p`` == 0
    disable theirs. ``seed`` makes sampling a pure function of (seed, sample index, position), so
    the same request samples the same tokens on any engine. ``logprobs`` = k returns the sampled
    token's logprob and the top-k alternatives (k = 0: the sampled token's only).
    ``n`` parallel samples share the prompt's KV blocks copy-on-write.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
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
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, x: object) -> None:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"{name} must be an integer, got {x!r}")
