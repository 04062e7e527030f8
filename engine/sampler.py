"""Token sampling: logits processing, greedy, temperature, top-k, top-p, min-p, logprobs.

Randomness is counter-based: the uniform draw for (seed, position, token) is a hash of the three,
computed in int64 tensors. Seeded sampling is therefore a pure function of (seed, position) on any
device and batch composition, which is what lets a prefill worker sample the first token and a
decode worker the rest, and still match one engine. No generator state, no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logits_processing import LogitsAdjustment
from engine.sampling_params import SamplingParams
from engine.structured_output import apply_bitmask

_M32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding uint32 values (products wrap mod 2^64)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor. A CPU float32 one goes through numpy, whose vectorized
    argmax is 8-11x faster than torch's (1 ns per element on one thread: at batch 256 over a 32k
    vocabulary, 10 ms a step) once the tensor is not tiny; both take the first maximum, and a NaN
    as the maximum."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.numel() >= 2048
        and not x.requires_grad
    ):
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 uniforms in (0, 1), one row per (seed, position)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = _fmix32(_fmix32(lo ^ _fmix32(hi + 0x9E3779B9)) ^ (positions & _M32))
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = _fmix32(row[:, None] ^ _fmix32(idx[None, :] * 0x27D4EB2F + 0x165667B1))
    return (x.to(torch.float32) + 0.5) / 4294967296.0


def sample_seed(seed: int, sample_index: int) -> int:
    """Seed of parallel sample ``sample_index`` of a request seeded with ``seed``."""
    if sample_index == 0:
        return seed
    x = torch.tensor([seed & _M32, sample_index], dtype=torch.int64)
    mixed = _fmix32(_fmix32(x[0]) ^ _fmix32(x[1] + 0x7F4A7C15))
    return (seed & ~_M32) | int(mixed)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors; built by the model runner each step. With
    ``all_greedy`` the tensors may be None: an argmax reads none of them."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64: index of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int | None  # None: no row wants logprobs
    adjust: LogitsAdjustment | None = None  # bad words, min_tokens, logit_bias, penalties
    token_bitmask: torch.Tensor | None = None  # [N, words] int32: structured outputs' allowed tokens

    @classmethod
    def for_rows(
        cls, rows: list[tuple[SamplingParams, int, int]], device: torch.device, **extra
    ) -> SamplingBatch:
        """One row per (params, seed, position of the token sampled); ``extra``: ``max_logprobs``,
        ``adjust``, ``token_bitmask``."""
        ps = [p for p, _, _ in rows]
        temps, top_ks = [p.temperature for p in ps], [p.top_k for p in ps]
        top_ps, min_ps = [p.top_p for p in ps], [p.min_p for p in ps]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_ps, dtype=torch.float32, device=device),
            seeds=torch.tensor([s for _, s, _ in rows], dtype=torch.int64, device=device),
            positions=torch.tensor([t for _, _, t in rows], dtype=torch.int64, device=device),
            all_greedy=all(t == 0 or k == 1 for t, k in zip(temps, top_ks)),
            any_top_k=any(k > 0 for k in top_ks),
            any_top_p=any(p < 1 for p in top_ps),
            any_min_p=any(m > 0 for m in min_ps),
            max_logprobs=extra.pop("max_logprobs", None),
            **extra,
        )

    @classmethod
    def from_device(
        cls, flags: tuple[bool, bool, bool] | None, tensors: dict[str, torch.Tensor] | None, **extra
    ) -> SamplingBatch:
        """From a step's sampling tensors, already on the device (engine.persistent_batch), and
        whether any row uses top-k, top-p, min-p; ``flags`` None means every row is greedy, and the
        sampler reads no tensor."""
        max_logprobs = extra.pop("max_logprobs", None)
        if flags is None:
            return cls(
                temperature=None, top_k=None, top_p=None, min_p=None, seeds=None, positions=None,
                all_greedy=True, any_top_k=False, any_top_p=False, any_min_p=False,
                max_logprobs=max_logprobs, **extra,
            )  # fmt: skip
        any_top_k, any_top_p, any_min_p = flags
        return cls(
            **tensors, all_greedy=False, any_top_k=any_top_k, any_top_p=any_top_p, any_min_p=any_min_p,
            max_logprobs=max_logprobs, **extra,
        )  # fmt: skip


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    sampled_logprobs: torch.Tensor | None  # [N]
    top_ids: torch.Tensor | None  # [N, k]
    top_logprobs: torch.Tensor | None  # [N, k]


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        # NOTE: logprobs are the model's own (before processing), as vLLM returns them by default.
        logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
        if batch.adjust is not None:
            logits = batch.adjust.apply(logits)
        if batch.token_bitmask is not None:
            logits = apply_bitmask(logits, batch.token_bitmask)
        greedy = row_argmax(logits)
        if batch.all_greedy:
            tokens = greedy
        else:
            tokens = torch.where(batch.temperature == 0, greedy, self._random(logits, batch))
        if logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        sampled = logprobs.gather(1, tokens[:, None]).squeeze(1)
        if batch.max_logprobs:
            top_lp, top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
        else:
            top_lp = top_ids = None
        return SamplerOutput(tokens, sampled, top_ids, top_lp)

    def _random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return exponential_race(filtered_probs(logits, batch), batch.seeds, batch.positions)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[N, V] the distribution a random row samples from: temperature, top-k, top-p, then min-p
    (min-p leaves it unnormalized; samplers here only need it up to a factor per row)."""
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / temp[:, None]
    if batch.any_top_k:
        logits = _apply_top_k(logits, batch.top_k)
    if batch.any_top_p:
        logits = _apply_top_p(logits, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    if batch.any_min_p:
        keep = probs >= batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
    return probs


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A token from each row of ``probs`` (unnormalized is fine): argmax p / E with E ~ Exp(1), the
    exponential race (Gumbel-max), its noise a function of (seed, position)."""
    u = uniform_noise(seeds, positions, probs.shape[-1])
    return row_argmax(probs / -torch.log(u))


def uniform_scalar(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N] float64 uniforms in (0, 1), one per (seed, position), independent of ``uniform_noise``'s
    (speculative decoding's acceptance draws)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = _fmix32(_fmix32(lo ^ _fmix32(hi + 0x51ED270B)) ^ _fmix32((positions & _M32) + 0x2545F491))
    return (row.to(torch.float64) + 0.5) / 4294967296.0


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top one always stays).
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
