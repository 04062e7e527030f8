"""Conversions between protobuf messages and the engine's plain values, shared by every service.

NOTE: imports only ``engine.sampling_params`` (torch-free), so the router may use it too.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams, StructuredOutput
from proto import pdserve_pb2 as pb


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (from SamplingParams' own validation) for out-of-range values."""
    return SamplingParams(
        n=p.n or 1,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        bad_words_token_ids=[list(w.ids) for w in p.bad_words],
        prior_output_tokens=p.prior_output_tokens,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        speculative=not p.no_speculation,
        lora=p.lora or None,
        structured=StructuredOutput(p.structured.kind, p.structured.value)
        if p.HasField("structured")
        else None,
    )


def params_to_proto(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        include_stop_str_in_output=s.include_stop_str_in_output,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=s.logit_bias,
        min_tokens=s.min_tokens,
        bad_words=[pb.TokenIds(ids=w) for w in s.bad_words_token_ids],
        prior_output_tokens=s.prior_output_tokens,
        no_speculation=not s.speculative,
        lora=s.lora or "",
    )
    if s.bad_words and not s.bad_words_token_ids:
        raise ValueError("bad_words must be tokenized into bad_words_token_ids before they cross the wire")
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.structured is not None:
        msg.structured.kind = s.structured.kind
        msg.structured.value = s.structured.value
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def logprobs_to_proto(entries: dict[int, float] | None) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        entries=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in (entries or {}).items()]
    )


def logprobs_from_proto(msg: pb.TokenLogprobs) -> dict[int, float] | None:
    return {e.token_id: e.logprob for e in msg.entries} or None


def prompt_logprobs_to_proto(entries: list[dict[int, float] | None] | None) -> list[pb.TokenLogprobs]:
    """Positions 1.. of a prompt's logprobs (position 0 has none)."""
    return [logprobs_to_proto(e) for e in (entries or [])[1:]]


def tokens_message(
    sample_index: int,
    token_ids: list[int],
    logprobs: list[dict[int, float] | None] | None = None,
    prompt_logprobs: list[dict[int, float] | None] | None = None,
    cached_tokens: int | None = None,
) -> pb.GenerateResponse:
    """A ``GenerateResponse`` carrying a ``TokenChunk``, built in place: the streams' per-token message.
    (``GenerateResponse(tokens=TokenChunk(..., logprobs=[], ...))`` costs several times as much: a
    nested message copied in, and empty repeated message fields set through keyword arguments.)"""
    msg = pb.GenerateResponse()
    chunk = msg.tokens
    chunk.sample_index = sample_index
    chunk.token_ids.extend(token_ids)
    if logprobs:
        chunk.logprobs.extend(logprobs_to_proto(lp) for lp in logprobs)
    if prompt_logprobs:
        chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(prompt_logprobs))
    if cached_tokens is not None:  # the request's first chunk
        chunk.cached_tokens = cached_tokens
    return msg


def stop_reason_text(reason: str | int | None) -> str:
    return "" if reason is None else str(reason)


def stop_reason_fields(reason: str | int | None) -> dict:
    """``Finished``'s stop fields for an engine's stop reason: a stop string, or a stop token's id
    (as text for older readers, and as the number)."""
    if isinstance(reason, int):
        return {"stop_reason": str(reason), "stop_token_id": reason}
    return {"stop_reason": stop_reason_text(reason)}


def stop_reason_of(finished) -> str | int | None:
    """The stop reason a ``Finished`` carries, as the engine gave it (a stop token's id an int)."""
    if finished.HasField("stop_token_id"):
        return finished.stop_token_id
    return finished.stop_reason or None
