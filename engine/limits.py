"""What an engine can ever serve, checkable without the engine: a request's static limits.

``EngineCore.validate`` checks these, then compiles a grammar; a worker whose engine runs in another
process (``worker.engine_process``) checks them at its edge from the ``RequestLimits`` the engine
reported, so a request that can never run is refused before it crosses to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def room(self, prompt_len: int) -> int:
        """The most tokens a prompt this long may generate: what the context and the whole KV pool
        leave it (at least 1, so a prompt with no room is refused by ``check`` with the reason)."""
        return max(1, min(self.max_model_len, self.num_blocks * self.block_size) - prompt_len)

    def resolved(self, prompt_len: int, params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_tokens=None`` made the prompt's ``room``."""
        return params if params.max_tokens is not None else replace(params, max_tokens=self.room(prompt_len))

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request these limits rule out (a grammar is not compiled here)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.max_num_seqs})")
        check_vocab(params, vocab)
        if params.prior_output_tokens >= n:
            raise ValueError(
                f"prior_output_tokens ({params.prior_output_tokens}) must be less than the prompt's {n} tokens"
            )
        params = self.resolved(n, params)
        total = n + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the model's "
                f"context length of {self.max_model_len} tokens"
            )
        blocks = -(-total // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {blocks} KV blocks but the "
                f"whole pool has {self.num_blocks}"
            )


def check_vocab(params: SamplingParams, vocab: int) -> None:
    """Token ids in the params must be this model's (they index the logits)."""
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
        ("bad_words_token_ids", (t for w in params.bad_words_token_ids for t in w)),
    ):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
    if params.bad_words and not params.bad_words_token_ids:
        raise ValueError("bad_words must be tokenized into bad_words_token_ids before they reach the engine")
