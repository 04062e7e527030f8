"""Offline throughput: pdserve's engine vs HF transformers, same process, model and workload.

Runs, one after another on the same random-weight Llama (~32M parameters: hidden 512, 8 layers,
8 heads, 4 KV heads, vocab 8192, float32) and the same skewed workload (48 requests, prompts 32-256
tokens, outputs 70% 8-64 / 20% 64-192 / 10% 192-384 tokens, EOS ignored):

1. HF ``generate`` with static batches of 8 (each batch runs to its longest request),
2. HF continuous batching (``init_continuous_batching``, per-request ``max_new_tokens``),
3. pdserve's ``LLM.generate`` (all requests at once; continuous batching, chunked prefill),

and prints generated tokens/s of each and pdserve's ratio to the better HF mode. Greedy outputs are
checked to agree between pdserve and HF static batching on the requests both produce.

    python -m bench.offline_throughput [--model DIR] [--num-requests 48] [--json out.json]
    python -m bench.offline_throughput --model DIR --device cuda --dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

from loadgen.workloads import BenchRequest, skewed_workload

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "bench-llama-35m"


def ensure_model(path: Path) -> Path:
    from engine.tiny_model import LLAMA_32M, create_tiny_model

    if not (path / "config.json").exists():
        print(f"creating the benchmark model in {path}", file=sys.stderr)
        create_tiny_model(path, "llama", **LLAMA_32M)
    return path


def run_pdserve(model_dir: Path, requests: list[BenchRequest], **engine_args) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), enable_prefix_caching=False, **engine_args)
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, desc="pdserve")
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "name": "pdserve",
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "outputs": [o.token_ids for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint dir (default: create the 35M bench model)"
    )
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", type=Path, help="write results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    model_dir = ensure_model(args.model or DEFAULT_MODEL_DIR)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    requests = skewed_workload(args.num_requests, vocab_size=vocab, seed=args.seed)
    results: list[dict] = []
    if not args.skip_hf:
        from bench.hf_baselines import load_hf_model, run_hf_continuous, run_hf_static

        hf = load_hf_model(str(model_dir), getattr(torch, args.dtype), args.device)
        run_hf_static(hf, requests[:2], progress=False)  # warm-up
        for fn in (run_hf_static, run_hf_continuous):
            r = fn(hf, requests)
            results.append(
                {
                    "name": r.name,
                    "seconds": r.seconds,
                    "generated_tokens": r.generated_tokens,
                    "tokens_per_s": r.tokens_per_s,
                    "outputs": r.output_token_ids,
                }
            )
        del hf
    results.append(
        run_pdserve(
            model_dir,
            requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            dtype=args.dtype,
        )
    )

    print(
        f"\nworkload: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print(f"{'system':<16}{'seconds':>10}{'gen tokens':>12}{'tokens/s':>11}")
    for r in results:
        print(f"{r['name']:<16}{r['seconds']:>10.2f}{r['generated_tokens']:>12}{r['tokens_per_s']:>11.1f}")
    ours = results[-1]
    summary = {"pdserve_tokens_per_s": ours["tokens_per_s"]}
    hf_results = results[:-1]
    if hf_results:
        best = max(hf_results, key=lambda r: r["tokens_per_s"])
        summary.update(
            {f"ratio_vs_{r['name']}": ours["tokens_per_s"] / r["tokens_per_s"] for r in hf_results}
        )
        summary["ratio_vs_best_hf"] = ours["tokens_per_s"] / best["tokens_per_s"]
        print(f"pdserve / best HF ({best['name']}): {summary['ratio_vs_best_hf']:.2f}x")
        static = next(r for r in hf_results if r["name"] == "hf-static")
        same = sum(a == b for a, b in zip(ours["outputs"], static["outputs"]))
        summary["greedy_outputs_equal_to_hf_static"] = f"{same}/{len(requests)}"
        print(f"greedy outputs identical to HF static batching: {same}/{len(requests)} requests")
    if args.json:
        payload = {
            "summary": summary,
            "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
