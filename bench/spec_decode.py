"""Speculative decoding on the trained pair (``pdserve train-tiny``): decode tokens/s with and without
each method, and the offline skewed workload against HF transformers' assisted generation.

Part 1, decode speed: B requests at once (B = 1, 4, 16), 64-token prompts cut from held-out standard
library files (never trained on), 128 greedy output tokens each; generated tokens/s of the engine
without speculation and with each method at k = 2 and 4, with acceptance rate and mean accepted
length (tokens a speculating step emits). Ratios are to the engine without speculation, same B.

Part 2, the offline skewed workload (48 requests, prompts 32-256 tokens of held-out code, outputs
70% 8-64 / 20% 64-192 / 10% 192-384 tokens, greedy, EOS ignored): the engine with and without its
best method of part 1 (always, and paused while 8 or more requests run: ``disable_by_batch_size``),
and HF transformers one request at a time (assisted generation serves batch
size 1 only): plain ``generate``, with the draft as ``assistant_model``, and with prompt lookup
(``prompt_lookup_num_tokens``). Greedy outputs are checked equal across all of them.

    python -m bench.spec_decode                       # about 6 minutes on 2 CPU cores
    python -m bench.spec_decode --batch-sizes 1 --skip-workload
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

RESULTS = Path(__file__).parent / "results"


def trained_pair() -> tuple[Path, Path]:
    from cli.train_tiny import CACHE, Recipe, train_tiny

    recipe = Recipe()
    if not (CACHE / recipe.key() / "metrics.json").exists():
        print(
            "training the model pair first (pdserve train-tiny, ~25 minutes on 2 cores, cached)",
            file=sys.stderr,
        )
    m = train_tiny(recipe)
    return Path(m["target"]["path"]), Path(m["draft"]["path"])


def held_out_windows(tokenizer, n: int, lengths: list[int], seed: int) -> list[list[int]]:
    """``n`` token windows of the given lengths from the standard library files the pair was not
    trained on."""
    from cli.train_tiny import Recipe, corpus_files, split

    _, val_files = split(corpus_files(), Recipe().val_every)
    ids = tokenizer.encode("\n".join(p.read_text(encoding="utf-8", errors="replace") for p in val_files))
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def method_configs(draft: Path) -> dict[str, dict | None]:
    configs: dict[str, dict | None] = {"none": None}
    for k in (2, 4):
        configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
        configs[f"early_exit(2) k={k}"] = {
            "method": "early_exit",
            "num_layers": 2,
            "num_speculative_tokens": k,
        }
        configs[f"draft_model k={k}"] = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": k,
        }
    return configs


def run_engine(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]], dict]:
    from engine import SamplingParams

    before = llm.stats()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    tokens = [o.outputs[0].token_ids for o in outs]
    spec = {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }
    return sum(map(len, tokens)) / seconds, tokens, spec


def decode_speed(target: Path, draft: Path, tokenizer, batch_sizes: list[int], threads: int) -> list[dict]:
    from engine import LLM

    configs = method_configs(draft)
    rows = []
    bar = tqdm(total=len(configs) * len(batch_sizes), desc="decode speed", unit="run")
    reference: dict[int, list[list[int]]] = {}
    for name, cfg in configs.items():
        llm = LLM(str(target), speculative_config=cfg, cpu_threads=threads, enable_prefix_caching=False)
        llm.generate([[11, 12, 13]], use_tqdm=False)  # warm-up
        for b in batch_sizes:
            prompts = held_out_windows(llm.tokenizer, b, [64], seed=b)
            tok_s, tokens, spec = run_engine(llm, prompts, [128] * b)
            if name == "none":
                reference[b] = tokens
            rows.append(
                {
                    "method": name,
                    "batch": b,
                    "tokens_per_s": tok_s,
                    "identical": tokens == reference[b],
                    **spec,
                }
            )
            bar.update()
    bar.close()
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["batch"]]
    return rows


def workload(target: Path, draft: Path, tokenizer, best: dict, threads: int, num_requests: int) -> list[dict]:
    from bench.hf_baselines import load_hf_model
    from engine import LLM
    from loadgen.workloads import _sample_skewed_output_len

    rng = random.Random(0)
    lengths = [rng.randint(32, 256) for _ in range(num_requests)]
    prompts = held_out_windows(tokenizer, num_requests, lengths, seed=1)
    max_tokens = [_sample_skewed_output_len(rng) for _ in prompts]
    results = []
    paused = {**best["config"], "disable_by_batch_size": 8}
    for name, cfg in (
        ("pdserve", None),
        (f"pdserve + {best['method']}", best["config"]),
        (f"pdserve + {best['method']}, off >= 8", paused),
    ):
        llm = LLM(str(target), speculative_config=cfg, cpu_threads=threads, enable_prefix_caching=False)
        llm.generate([[11, 12, 13]], use_tqdm=False)
        tok_s, tokens, spec = run_engine(llm, prompts, max_tokens)
        results.append({"name": name, "tokens_per_s": tok_s, "outputs": tokens, **spec})
        del llm
    hf = load_hf_model(str(target), torch.float32, "cpu")
    assistant = load_hf_model(str(draft), torch.float32, "cpu")
    for m in (hf, assistant):  # EOS ignored, as the engine's requests do
        m.generation_config.eos_token_id = None
    for name, extra in (
        ("HF generate", {}),
        ("HF assisted (draft)", {"assistant_model": assistant}),
        ("HF prompt lookup", {"prompt_lookup_num_tokens": 4}),
    ):
        outputs, generated = [], 0
        t0 = time.perf_counter()
        for p, m in tqdm(list(zip(prompts, max_tokens)), desc=name, unit="req"):
            ids = torch.tensor([p])
            with torch.no_grad():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=m,
                    do_sample=False,
                    pad_token_id=0,
                    **extra,
                )
            outputs.append(out[0, len(p) :].tolist())
            generated += len(outputs[-1])
        results.append(
            {"name": name, "tokens_per_s": generated / (time.perf_counter() - t0), "outputs": outputs}
        )
    ref = results[0]["outputs"]
    for r in results:
        r["identical"] = sum(a == b for a, b in zip(r.pop("outputs"), ref)) / len(ref)
    return results


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "none"]
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        vals = [next(r["speedup"] for r in rows if r["method"] == m and r["batch"] == b) for m in methods]
        ax.bar([x + i * width for x in range(len(methods))], vals, width, label=f"batch {b}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(batches) - 1) / 2 for x in range(len(methods))], methods, rotation=20)
    ax.set_ylabel("decode tokens/s vs no speculation")
    ax.set_title("Speculative decoding on the trained 12.6M pair (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of the engine (default: 1, a replica's)"
    )
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--skip-workload", action="store_true")
    p.add_argument("--output", type=Path, default=RESULTS / "spec_decode.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = trained_pair()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = decode_speed(target, draft, tokenizer, args.batch_sizes, args.threads)
    print(
        f"\ntorch {torch.__version__}, {args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    print(f"{'method':<20}{'batch':>6}{'tokens/s':>10}{'ratio':>8}{'accept':>8}{'mean len':>10}{'same':>6}")
    for r in rows:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        mlen = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(
            f"{r['method']:<20}{r['batch']:>6}{r['tokens_per_s']:>10.1f}{r['speedup']:>7.2f}x{acc:>8}{mlen:>10}"
            f"{'yes' if r['identical'] else 'NO':>6}"
        )
    out = {"decode_speed": rows}
    speculative = [r for r in rows if r["method"] != "none" and r["batch"] == min(args.batch_sizes)]
    best = max(speculative, key=lambda r: r["speedup"])
    best_cfg = method_configs(draft)[best["method"]]
    if not args.skip_workload:
        res = workload(
            target,
            draft,
            tokenizer,
            {"method": best["method"], "config": best_cfg},
            args.threads,
            args.num_requests,
        )
        print(f"\nskewed workload ({args.num_requests} requests, held-out code prompts):")
        print(f"{'system':<36}{'tokens/s':>10}{'vs HF generate':>16}{'same output':>13}")
        hf = next(r for r in res if r["name"] == "HF generate")["tokens_per_s"]
        for r in res:
            print(
                f"{r['name']:<36}{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / hf:>15.2f}x{r['identical']:>13.0%}"
            )
        out["workload"] = res
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2))
    plot(rows, args.output.with_suffix(".png"))
    print(f"\nwrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
