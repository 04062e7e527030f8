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

One run's sets share no prompt (``RequestSets``): a prompt sent twice is a prefix-cache hit the
second time, which would measure the cache instead of the server. Level ``i`` of a sweep (0
without one) draws ``--num-prompts`` with ``--seed + i``; the warm-up draws ``--warmup`` with
``--seed + WARMUP_SEED_OFFSET``. ShareGPT's prompts all come from one file, shuffled with
``--seed`` and dealt out instead: level ``i`` takes the ``i``-th ``--num-prompts`` from the front,
the warm-up the last ones; a file too small for that repeats prompts, with a warning.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from loadgen.workloads import random_workload, skewed_workload

DATASETS = ("random", "prefix", "sharegpt", "skewed", "interference")
WARMUP_SEED_OFFSET = 1 << 32  # the warm-up's seed is --seed + this: no sweep has that many levels

logger = logging.getLogger(__name__)


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


def sharegpt_pairs(path: str, seed: int, tokenizer: str | None = None) -> list[ServingRequest]:
    """Every conversation of the file with a human turn and an answer, shuffled with ``seed``."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON (or not UTF-8)
        raise ValueError(f"--dataset-path {path} is not a JSON file: {exc}") from None
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    pairs = []
    items = data if isinstance(data, list) else []
    for item in (i for i in items if isinstance(i, dict)):
        turns = item.get("conversations") or item.get("conversation") or []
        human = next((t["value"] for t in turns if t.get("from") in ("human", "user")), None)
        answer = next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), None)
        if human and answer:
            length = len(tok.encode(answer)) if tok else int(len(answer.split()) * 1.3)
            pairs.append(ServingRequest(human, max(4, min(length, 2048))))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a human turn and an answer")
    random.Random(seed).shuffle(pairs)
    return pairs


def _synthetic(args, n: int, seed: int) -> list[ServingRequest]:
    vocab = args.vocab_size
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
    raise ValueError(f"unknown dataset {args.dataset!r}; choose from {DATASETS}")


class RequestSets:
    """The measured sets and the warm-up of one run, no two sharing a prompt (the module's docstring
    says how each is drawn). A ShareGPT file is read once, however many sets it deals."""

    def __init__(self, args) -> None:
        self.args = args
        self.pairs: list[ServingRequest] = []
        if args.dataset == "sharegpt":
            if not args.dataset_path:
                raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
            self.pairs = sharegpt_pairs(args.dataset_path, args.seed, args.tokenizer)

    def level(self, i: int) -> list[ServingRequest]:
        """The ``--num-prompts`` requests level ``i`` of a sweep measures (0: a run without one)."""
        n = self.args.num_prompts
        if not self.pairs:
            return _synthetic(self.args, n, self.args.seed + i)
        if (i + 1) * n + self.args.warmup > len(self.pairs):
            logger.warning(
                "%s holds %d conversations, too few for %d set(s) of --num-prompts %d and --warmup %d "
                "apart: prompts repeat, and a repeated prompt's TTFT is a prefix-cache hit",
                self.args.dataset_path,
                len(self.pairs),
                i + 1,
                n,
                self.args.warmup,
            )
        return self._deal(i * n, n)

    def warmup(self) -> list[ServingRequest]:
        """The ``--warmup`` requests sent first and not measured."""
        if not self.pairs:
            return _synthetic(self.args, self.args.warmup, self.args.seed + WARMUP_SEED_OFFSET)
        return self._deal(len(self.pairs) - self.args.warmup, self.args.warmup)

    def _deal(self, start: int, n: int) -> list[ServingRequest]:
        return [self.pairs[(start + k) % len(self.pairs)] for k in range(n)]


def build(args) -> list[ServingRequest]:
    """The requests of a run without a sweep (``RequestSets(args).level(0)``)."""
    return RequestSets(args).level(0)
