"""Multi-LoRA throughput: 8 adapters mixed uniformly in one batch against the base model alone, in the
same run, and what swapping adapters into device slots costs.

The model has the shape of ``pdserve train-tiny``'s target (12.6M parameters: hidden 384, 6 layers,
vocabulary 8192) with random weights, or ``--model`` (a checkpoint or Hugging Face id); the 8
adapters are random, rank 16 on every projection of every layer (what throughput depends on is
their shapes, not their values). One workload (``--requests`` prompts of ``--prompt-len`` tokens,
``--output-len`` generated each, EOS ignored) runs on:

1. ``base``: the engine without LoRA;
2. ``base, LoRA on``: the engine with 8 adapters loaded, every request on the base model (the cost
   of serving adapters at all);
3. ``8 adapters``: request ``i`` on adapter ``i % 8``, 8 device slots (every adapter resident);
4. ``8 adapters, 2 slots``: the same with 2 device slots: the scheduler runs at most 2 adapters at
   once and copies each in when its turn comes (swaps).

Each runs ``--rounds`` times, alternating, and keeps its best (the machine's speed varies); ratios
are against ``base``. Swap cost: the mean time to copy an adapter into a slot, and its share of the
run. Target: 8 adapters >= 0.8x the base model's throughput.

    python -m bench.lora_throughput        # about 20 s on 2 CPU cores
    python -m bench.lora_throughput --device cuda --dtype bfloat16 --requests 256 --model <a real model>
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

RESULTS = Path(__file__).parent / "results"
NUM_ADAPTERS = 8
TRAINED_SHAPE = dict(  # cli/train_tiny.py's Recipe: the target's shape
    vocab_size=8192,
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=1024,
    max_position_embeddings=1024,
)


def model_and_adapters(model: str | None, work: Path, rank: int) -> tuple[str, dict[str, str]]:
    from engine.lora.adapter import random_adapter
    from engine.models.loader import load_hf_config, resolve_model_path, spec_from_hf_config
    from engine.tiny_model import create_tiny_model

    if model is None:
        model = str(create_tiny_model(work / "model", "llama", **TRAINED_SHAPE))
    spec = spec_from_hf_config(load_hf_config(resolve_model_path(model)))
    adapters = {
        f"lora{i}": str(random_adapter(work / f"lora{i}", spec, rank, seed=i)) for i in range(NUM_ADAPTERS)
    }
    return model, adapters


CONFIGS = {  # name -> (engine options, whether requests name adapters)
    "base": ({}, False),
    "base, LoRA on": ({"max_loras": NUM_ADAPTERS}, False),
    "8 adapters": ({"max_loras": NUM_ADAPTERS}, True),
    "8 adapters, 2 slots": ({"max_loras": 2}, True),
}


def run_config(model: str, adapters: dict, name: str, prompts, args) -> dict:
    from engine import LLM, SamplingParams

    options, named = CONFIGS[name]
    lora = {"lora_modules": adapters, "max_lora_rank": args.rank, **options} if options else {}
    llm = LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        cpu_threads=args.threads,
        enable_prefix_caching=False,
        num_blocks=args.num_blocks,
        **lora,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    names = [f"lora{i % NUM_ADAPTERS}" for i in range(len(prompts))] if named else None
    llm.generate(prompts[:4], params, lora=names[:4] if names else None, use_tqdm=False)  # warm-up
    slots = llm.core.lora_slots
    loads0, load_s0 = (slots.num_loads, slots.load_seconds) if slots else (0, 0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=names, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {
        "config": name,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "steps": llm.stats().num_steps,
    }
    if slots:
        loads, load_s = slots.num_loads - loads0, slots.load_seconds - load_s0
        row.update(swaps=loads, swap_ms=1e3 * load_s / loads if loads else 0.0, swap_share=load_s / seconds)
        row["slot_mib"] = slots.bytes / 2**20
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="a checkpoint or HF id (default: random, train-tiny's shape)"
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the Triton kernels)")
    p.add_argument("--dtype", default="float32", help="float32, or bfloat16 on a GPU")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--output", type=Path, default=RESULTS / "lora_throughput.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, adapters = model_and_adapters(args.model, Path(tmp), args.rank)
        rng = random.Random(0)
        vocab = 8192 if args.model is None else 1000
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        best: dict[str, dict] = {}
        runs = [name for _ in range(args.rounds) for name in CONFIGS]
        for name in tqdm(runs, desc="lora throughput", unit="run"):
            row = run_config(model, adapters, name, prompts, args)
            if name not in best or row["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = row
    base = best["base"]["tokens_per_s"]
    rows = [best[name] | {"vs_base": best[name]["tokens_per_s"] / base} for name in CONFIGS]
    print(
        f"\n{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} generated) tokens, "
        f"{NUM_ADAPTERS} adapters of rank {args.rank}, {args.device} {args.dtype}"
        + (f" ({args.threads} thread(s))" if args.device == "cpu" else "")
        + f", best of {args.rounds}:"
    )
    print(f"{'config':<22}{'tokens/s':>10}{'vs base':>9}{'swaps':>7}{'ms/swap':>9}{'swap share':>12}")
    for r in rows:
        swaps = f"{r['swaps']:>7}{r['swap_ms']:>9.2f}{r['swap_share']:>12.1%}" if "swaps" in r else ""
        print(f"{r['config']:<22}{r['tokens_per_s']:>10.0f}{r['vs_base']:>8.2f}x{swaps}")
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, args.output.with_suffix(".png"), args)
    print(f"wrote {args.output}")
    return 0


def plot(rows: list[dict], path: Path, args) -> None:
    try:
        import matplotlib
    except ImportError:  # a bare GPU host: the JSON has the figures
        print("matplotlib is not installed: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = [r["config"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax.bar(names, values, color=["#777", "#999", "#3a7", "#c83"])
    for bar, r in zip(bars, rows):
        ax.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height(),
            f"{r['vs_base']:.2f}x",
            ha="center",
            va="bottom",
        )
    ax.axhline(0.8 * rows[0]["tokens_per_s"], color="r", ls="--", lw=0.8, label="0.8x base (target)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(
        f"multi-LoRA: {NUM_ADAPTERS} adapters of rank {args.rank} mixed in one batch vs the base model"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
