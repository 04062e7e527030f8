"""A completion's prompt logprobs in the answer: vLLM's ``prompt_logprobs`` field, and OpenAI's
``echo`` with ``logprobs`` (the prompt's tokens leading the choice's ``logprobs`` lists).

The workers send, with a request's first tokens, each prompt position's {token: logprob} (the
prompt's own token first, then the top alternatives); position 0 has none (``None``).
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from ingress.token_text import TokenTexts

Entries = list[dict[int, float] | None]


def vllm_prompt_logprobs(entries: Entries, prompt: list[int], k: int, tokenizer) -> list[dict | None]:
    """vLLM's shape: per prompt token None (the first) or {"token id": {"logprob", "decoded_token"}},
    the prompt's own token and its top-k alternatives."""
    out: list[dict | None] = []
    for pos, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        own = prompt[pos]
        keep = [own, *[t for t in sorted(entry, key=lambda t: -entry[t]) if t != own][:k]]
        out.append(
            {
                str(t): {"logprob": max(entry[t], -9999.0), "decoded_token": tokenizer.decode([t])}
                for t in keep
                if t in entry
            }
        )
    return out


def echoed_logprobs(entries: Entries, prompt: list[int], k: int, texts: TokenTexts) -> tuple[dict, int]:
    """OpenAI's completions ``logprobs`` lists for the echoed prompt, and the prompt text's length
    (the generated tokens' ``text_offset`` follow it)."""
    detok = IncrementalDetokenizer(texts.tokenizer, [], SamplingParams())
    detok.add(prompt)
    detok.flush()
    strings = texts.sampled(prompt, detok.pieces, False)
    tokens, lps, tops, offsets, at = [], [], [], [], 0
    for pos, ((token, _), tid) in enumerate(zip(strings, prompt)):
        entry = entries[pos] if pos < len(entries) else None
        tokens.append(token)
        offsets.append(at)
        at += len(detok.pieces[pos] or "")
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(max(entry.get(tid, -9999.0), -9999.0))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        context = prompt[max(0, pos - 4) : pos]
        top = {(token if t == tid else texts.alternative(context, t)[0]): max(v, -9999.0) for t, v in best}
        top.setdefault(token, lps[-1])  # the prompt's own token too, as for a sampled one
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, len(
        detok.text
    )
