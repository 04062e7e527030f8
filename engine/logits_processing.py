"""Logits processing before sampling: bad words, min_tokens, logit_bias and the three penalties.

The runner builds one ``LogitsAdjustment`` per step for the rows whose ``SamplingParams`` ask for any
of these (``processes_logits``); rows that don't cost nothing, and a step where none does builds
nothing. Everything is gathered from the host's own copy of each sequence's tokens and copied to
the device in a few index tensors, so the step adds no device -> host sync. The order is vLLM's:
bans (bad words, then EOS / stop tokens under ``min_tokens``), ``logit_bias``, then
``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``.

A sequence's *output* starts at ``output_start``: normally its prompt length, earlier when tokens it
generated before were carried in its prompt (a request resumed on another worker, a decode worker
recomputing a prompt whose first token a prefill worker sampled). Penalties and bad words count
those tokens as output, so a moved request samples what it would have. ``min_tokens``, like
``max_tokens``, is a budget of the tokens still to generate: whoever moves a request lowers both
by the tokens carried, and the rule counts from the prompt's end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.device_copy import ints_on, to_device
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RowHistory:
    """What one sample row's processing reads: its params and its tokens so far."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output
    output_start: int
    prompt_len: int  # >= output_start: the tokens carried in the prompt are output, not budget
    eos_token_ids: frozenset[int]
    # The prompt's distinct tokens on the device (repetition_penalty): the runner keeps them per
    # sequence, so a long prompt is not gathered again every step.
    prompt_tokens: torch.Tensor | None = None

    def distinct_prompt_tokens(self, device: torch.device) -> torch.Tensor:
        if self.prompt_tokens is None:
            ids = sorted(set(self.token_ids[: self.output_start]))
            self.prompt_tokens = ints_on(ids, device)
        return self.prompt_tokens

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.output_start :]


def banned_tokens(row: RowHistory) -> set[int]:
    """Tokens this row may not sample now: completions of bad words, and EOS / stop tokens while
    the output is shorter than ``min_tokens``."""
    p = row.params
    out = row.output
    banned: set[int] = set()
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
            banned.add(word[-1])
    if len(row.token_ids) - row.prompt_len < p.min_tokens:
        banned.update(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(row.eos_token_ids)
    return banned


@dataclass(slots=True)
class LogitsAdjustment:
    """One step's processing as index tensors over the [N, V] logits."""

    ban_rows: torch.Tensor
    ban_cols: torch.Tensor
    bias_rows: torch.Tensor
    bias_cols: torch.Tensor
    bias_values: torch.Tensor
    penalty_rows: torch.Tensor  # [P] rows with a penalty
    repetition: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    output_rows: torch.Tensor  # index into penalty_rows, one entry per output token occurrence
    output_cols: torch.Tensor
    prompt_rows: torch.Tensor  # index into penalty_rows, one entry per prompt token occurrence
    prompt_cols: torch.Tensor

    @classmethod
    def build(cls, rows: Iterable[tuple[int, RowHistory]], device: torch.device) -> LogitsAdjustment | None:
        """From (logits row, history) pairs of the rows that process logits; None when none does."""
        ban_r: list[int] = []
        ban_c: list[int] = []
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        pen_rows: list[int] = []
        rep: list[float] = []
        freq: list[float] = []
        pres: list[float] = []
        out_r: list[int] = []
        out_c: list[int] = []
        prompts: list[tuple[int, torch.Tensor]] = []  # (penalty row, its prompt's distinct tokens)
        for i, row in rows:
            p = row.params
            for t in banned_tokens(row):
                ban_r.append(i)
                ban_c.append(t)
            for t, v in p.logit_bias.items():
                bias_r.append(i)
                bias_c.append(t)
                bias_v.append(v)
            if p.penalized:
                k = len(pen_rows)
                pen_rows.append(i)
                rep.append(p.repetition_penalty)
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
                out = row.output
                out_r.extend([k] * len(out))
                out_c.extend(out)
                if p.repetition_penalty != 1:
                    prompts.append((k, row.distinct_prompt_tokens(device)))
        if not (ban_r or bias_r or pen_rows):
            return None

        def ints(xs: list[int]) -> torch.Tensor:
            return ints_on(xs, device)

        def floats(xs: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(xs, dtype=torch.float32), device)

        return cls(
            ints(ban_r),
            ints(ban_c),
            ints(bias_r),
            ints(bias_c),
            floats(bias_v),
            ints(pen_rows),
            floats(rep),
            floats(freq),
            floats(pres),
            ints(out_r),
            ints(out_c),
            torch.cat([torch.full_like(t, k) for k, t in prompts]) if prompts else ints([]),
            torch.cat([t for _, t in prompts]) if prompts else ints([]),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed float32 logits (a new tensor; the input is left as it was)."""
        logits = logits.clone()
        if self.ban_rows.numel():
            logits[self.ban_rows, self.ban_cols] = float("-inf")
        if self.bias_rows.numel():
            logits.index_put_((self.bias_rows, self.bias_cols), self.bias_values, accumulate=True)
        if self.penalty_rows.numel():
            logits[self.penalty_rows] = self._penalized(logits[self.penalty_rows])
        return logits

    def _penalized(self, sub: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(sub)
        counts.index_put_(
            (self.output_rows, self.output_cols),
            torch.ones_like(self.output_cols, dtype=sub.dtype),
            accumulate=True,
        )
        present = counts > 0
        seen = present.clone()
        seen[self.prompt_rows, self.prompt_cols] = True
        rep = self.repetition[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        return sub - self.frequency[:, None] * counts - self.presence[:, None] * present.to(sub.dtype)
