"""Request sets for the serving benchmark (``pdserve bench``), deterministic for a seed.

- ``random``: token-id prompts with input/output lengths uniform in ``len * [1 - r, 1 + r]``.
- ``prefix``: multi-tenant: ``N`` shared prefixes of ``P`` tokens, each request one of them plus a
  unique ``S``-token suffix (what prefix caching and cache-aware routing exploit).
- ``sharegpt``: a local ShareGPT-format JSON file (``[{"conversations": [{"from": "human", "value":
  ...}, {"from": "gpt", "value": ...}, ...]}]``): the first human turn is the prompt (text), the
  first answer's length (in words x 1.3, or in tokens with ``--tokenizer``) the output length.
- ``skewed``: the offline engine benchmark's mix (prompts 32-256 tokens; outputs 70% 8-64, 20%
  64-192, 10% 192-384 tokens).
- ``interference``: long prompts mixed with short chat turns (prefill work interfering with
  decoding), for the disaggregated-vs-aggregated comparison.
Token-id prompts use ids in ``[10, vocab_size)``, accepted by any server whose vocabulary is that big.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadgen.workloads import random_workload, skewed_workload

DATASETS = ("random", "prefix", "sharegpt", "skewed", "interference")


@dataclass(frozen=True, slots=True)
class ServingRequest:
    prompt: str | list[int]
    max_tokens: int
    tenant: int = 0  # the shared prefix a prefix-dataset request uses (else 0)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def prefix_dataset(
    n: int,
    prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    skew: float = 0.0,
) -> list[ServingRequest]:
    """``skew`` > 0: tenant ``t`` is picked with weight ``1 / (t + 1) ** skew`` (Zipf: a few hot
    tenants); 0: uniformly."""
    rng = random.Random(seed)
    shared = [_ids(rng, prefix_len, vocab) for _ in range(prefixes)]
    weights = [1 / (t + 1) ** skew for t in range(prefixes)]
    out = []
    for _ in range(n):
        t = rng.choices(range(prefixes), weights)[0] if skew else rng.randrange(prefixes)
        out.append(ServingRequest(shared[t] + _ids(rng, suffix_len, vocab), output_len, tenant=t))
    return out


def interference_dataset(
    n: int, long_len: int, short_len: int, long_fraction: float, output_len: int, vocab: int, seed: int
) -> list[ServingRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < long_fraction:
            out.append(ServingRequest(_ids(rng, long_len, vocab), 8))  # a document to digest
        else:
            out.append(ServingRequest(_ids(rng, short_len, vocab), output_len))  # a chat turn
    return out


def sharegpt_dataset(path: str, n: int, seed: int, tokenizer: str | None = None) -> list[ServingRequest]:
    data = json.loads(Path(path).read_text())
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        human = next((t["value"] for t in turns if t.get("from") in ("human", "user")), None)
        answer = next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), None)
        if human and answer:
            length = len(tok.encode(answer)) if tok else int(len(answer.split()) * 1.3)
            pairs.append((human, max(4, min(length, 2048))))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a human turn and an answer")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    return [ServingRequest(p, m) for p, m in (pairs * (n // len(pairs) + 1))[:n]]


def build(args) -> list[ServingRequest]:
    n, vocab, seed = args.num_prompts, args.vocab_size, args.seed
    if args.dataset == "random":
        reqs = random_workload(n, args.input_len, args.output_len, args.range_ratio, vocab, seed)
        return [ServingRequest(r.prompt_token_ids, r.max_tokens) for r in reqs]
    if args.dataset == "skewed":
        return [
            ServingRequest(r.prompt_token_ids, r.max_tokens)
            for r in skewed_workload(n, vocab_size=vocab, seed=seed)
        ]
    if args.dataset == "prefix":
        return prefix_dataset(
            n, args.num_prefixes, args.prefix_len, args.suffix_len, args.output_len, vocab, seed
        )
    if args.dataset == "interference":
        return interference_dataset(
            n, args.long_len, args.input_len, args.long_fraction, args.output_len, vocab, seed
        )
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
        return sharegpt_dataset(args.dataset_path, n, seed, args.tokenizer)
    raise ValueError(f"unknown dataset {args.dataset!r}; choose from {DATASETS}")
