"""Quantized KV cache on the trained model (``pdserve train-tiny``): accuracy against full precision,
and capacity under a tight memory budget.

1. Accuracy: perplexity of the target on held-out standard library code (windows of 512 tokens,
   scored with ``prompt_logprobs``, so attention reads the quantized cache at every position), and
   greedy agreement with full precision over 128 generated tokens per prompt (the share of positions
   equal, and the mean length of the identical prefix).
2. Capacity: the skewed workload (48 requests, held-out code prompts of 32-256 tokens, outputs
   8-384 tokens) with a KV budget of ``--budget-mib`` (too small for the workload at float32): KV
   blocks, preemptions and generated tokens/s per KV dtype.

    python -m bench.kv_quant          # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.spec_decode import held_out_windows, trained_pair

RESULTS = Path(__file__).parent / "results"
KV_DTYPES = ("auto", "int8", "fp8")


def perplexity(llm, windows: list[list[int]]) -> float:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate(windows, params, use_tqdm=False)
    nll = [-next(iter(e.values())) for o in outs for e in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of positions equal, mean identical-prefix length)."""
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    return same / total, sum(prefixes) / len(prefixes)


def accuracy(target: Path, tokenizer, threads: int) -> list[dict]:
    from engine import LLM

    windows = held_out_windows(tokenizer, 24, [512], seed=7)
    prompts = held_out_windows(tokenizer, 32, [64], seed=8)
    rows, ref = [], None
    for kv in tqdm(KV_DTYPES, desc="accuracy", unit="dtype"):
        llm = LLM(str(target), kv_cache_dtype=kv, cpu_threads=threads, enable_prefix_caching=False)
        ppl = perplexity(llm, windows)
        out = greedy(llm, prompts, 128)
        ref = ref or out
        share, prefix = agreement(ref, out)
        rows.append(
            {"kv_cache_dtype": kv, "perplexity": ppl, "greedy_agreement": share, "identical_prefix": prefix}
        )
    base = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_change"] = r["perplexity"] / base - 1
    return rows


def capacity(target: Path, tokenizer, threads: int, budget_mib: float) -> list[dict]:
    from engine import LLM, SamplingParams
    from loadgen.workloads import _sample_skewed_output_len

    rng = random.Random(0)
    lengths = [rng.randint(32, 256) for _ in range(48)]
    prompts = held_out_windows(tokenizer, 48, lengths, seed=1)
    params = [
        SamplingParams(temperature=0, max_tokens=_sample_skewed_output_len(rng), ignore_eos=True)
        for _ in prompts
    ]
    rows = []
    for kv in tqdm(KV_DTYPES, desc="capacity", unit="dtype"):
        llm = LLM(
            str(target),
            kv_cache_dtype=kv,
            cpu_threads=threads,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=int(budget_mib * 2**20),
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = llm.stats()
        rows.append(
            {
                "kv_cache_dtype": kv,
                "kv_blocks": stats.num_blocks,
                "tokens_capacity": stats.num_blocks * llm.core.config.block_size,
                "bytes_per_token": llm.core.layout.block_bytes / llm.core.config.block_size,
                "preemptions": stats.num_preemptions,
                "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget-mib", type=float, default=12.0, help="KV budget of the capacity run")
    p.add_argument("--output", type=Path, default=RESULTS / "kv_quant.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = trained_pair()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    acc = accuracy(target, tokenizer, args.threads)
    print("\naccuracy (24 held-out windows of 512 tokens; 32 prompts x 128 greedy tokens):")
    print(f"{'kv dtype':<10}{'perplexity':>12}{'change':>9}{'greedy same':>13}{'same prefix':>13}")
    for r in acc:
        print(
            f"{r['kv_cache_dtype']:<10}{r['perplexity']:>12.3f}{r['perplexity_change']:>+9.2%}"
            f"{r['greedy_agreement']:>13.1%}{r['identical_prefix']:>13.1f}"
        )
    cap = capacity(target, tokenizer, args.threads, args.budget_mib)
    print(f"\ncapacity (skewed workload, 48 requests, KV budget {args.budget_mib} MiB):")
    print(
        f"{'kv dtype':<10}{'bytes/token':>12}{'tokens fit':>12}{'preemptions':>13}{'tokens/s':>10}{'vs auto':>9}"
    )
    for r in cap:
        print(
            f"{r['kv_cache_dtype']:<10}{r['bytes_per_token']:>12.0f}{r['tokens_capacity']:>12}{r['preemptions']:>13}"
            f"{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / cap[0]['tokens_per_s']:>8.2f}x"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"accuracy": acc, "capacity": cap}, indent=2))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
