"""What the offline API returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # why the engine failed it (finish_reason "error")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, {token: logprob, alternatives...}; the
    # first is None.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    # The first sample, for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
