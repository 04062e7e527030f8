"""``pdserve train-lora``: LoRA adapters that have learned something, on ``pdserve train-tiny``'s model.

Random adapters change the output but mean nothing; these are trained, each on a distinct slice of
the Python standard library's sources (a package: ``asyncio`` and ``unittest`` by default), so the demo
and the benchmarks show an adapter pulling the model toward its slice. Each is rank 8 on every
projection of every layer, trained from the trained target (``pdserve train-tiny`` runs first when it
has not), with a fixed seed and step count, then saved in PEFT's format (``peft`` and the engine load
it) under ``~/.cache/pdserve/trained-lora/<recipe hash>/<name>``, with ``metrics.json``: each
adapter's validation loss on held-out files of its slice against the base model's. A finished run
is reused; ``--force`` retrains.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cli.train_tiny import (
    Recipe,
    corpus_files,
    encode,
    evaluate,
    keyed,
    resolve_corpus,
    reuse,
    split,
    train,
    train_tiny,
)

CACHE = Path.home() / ".cache" / "pdserve" / "trained-lora"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraRecipe:
    slices: tuple[str, ...] = ("asyncio", "unittest")  # one adapter per package of the corpus
    rank: int = 8
    alpha: float = 16.0
    steps: int = 150
    lr: float = 2e-3
    warmup: int = 10
    seq_len: int = 256
    batch_size: int = 8
    seed: int = 0
    val_every: int = 5  # files of a slice: one in this many (by name) is held out
    precision: str = "float32"  # as train-tiny's Recipe

    def key(self, base: Path) -> str:
        text = json.dumps([dataclasses.asdict(self), str(base)], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def slice_files(files: list[Path], root: Path, package: str) -> list[Path]:
    """The files of ``package`` (its directory under ``root``)."""
    return [p for p in files if p.relative_to(root).parts[0] == package]


def attach_lora(model, rank: int, alpha: float) -> dict:
    """Wrap every target projection of ``model`` (an HF Llama) with a trainable low-rank update
    (``A`` random, ``B`` zero: the model starts unchanged) and freeze the rest; the wrappers by
    (layer, projection)."""
    import torch
    from torch import nn

    class LoraLinear(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
            self.b = nn.Parameter(torch.zeros(base.out_features, rank))
            self.scale = alpha / rank

        def forward(self, x):
            return self.base(x) + (x @ self.a.T @ self.b.T) * self.scale

    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = {}
    for i, layer in enumerate(model.model.layers):
        for proj in TARGETS:
            parent = layer.mlp if proj in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
            w = LoraLinear(getattr(parent, proj))
            setattr(parent, proj, w)
            wrapped[(i, proj)] = w
    return wrapped


def train_lora(
    recipe: LoraRecipe,
    base: Path | None = None,
    corpus: Path | None = None,
    out: Path | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict:
    """Train (or reuse) one adapter per slice; returns the metrics (paths, validation losses)."""

    import torch
    import transformers

    from engine.lora.adapter import save_adapter

    root = resolve_corpus(corpus)
    base = Path(base or train_tiny(Recipe(), progress=progress)["target"]["path"])
    key = recipe.key(base) if corpus is None else keyed(recipe.key(base), str(root))
    out = Path(out or CACHE / key)
    wanted = {"recipe": dataclasses.asdict(recipe), "base": str(base), "corpus": str(root)}
    done = out / "metrics.json"
    reused = reuse(done, wanted, force)
    if reused is not None:
        return reused
    files = corpus_files(root)
    if (base.is_absolute() or str(base).startswith((".", "~"))) and not base.expanduser().is_dir():
        raise ValueError(f"--base {base}: no such directory")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    except OSError as exc:  # no such directory, nor a model id transformers can fetch
        raise ValueError(f"--base {base}: {str(exc).splitlines()[0]}") from None
    metrics: dict = {**wanted, "adapters": {}}
    t0 = time.perf_counter()
    for name in recipe.slices:
        train_files, val_files = split(slice_files(files, root, name), recipe.val_every)
        if not train_files or not val_files:
            raise ValueError(f"too few files of {name!r} under {root} to train and validate an adapter")
        data = encode(tokenizer, [p.read_text(encoding="utf-8", errors="replace") for p in train_files])
        val = encode(tokenizer, [p.read_text(encoding="utf-8", errors="replace") for p in val_files])
        torch.manual_seed(recipe.seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        base_loss = evaluate(model, val, recipe.seq_len)
        wrapped = attach_lora(model, recipe.rank, recipe.alpha)
        last = train(model, data, recipe, recipe.steps, f"train adapter {name}", progress)
        loss = evaluate(model, val, recipe.seq_len)
        path = save_adapter(
            out / name, {k: (w.a, w.b) for k, w in wrapped.items()}, recipe.alpha, base_model=str(base)
        )
        metrics["adapters"][name] = {
            "path": str(path),
            "train_tokens": len(data),
            "train_loss": last,
            "val_loss": loss,
            "base_val_loss": base_loss,
            "val_ppl": math.exp(loss),
            "base_val_ppl": math.exp(base_loss),
        }
    metrics["seconds"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(metrics, indent=2))
    return json.loads(done.read_text())  # as a reuse reads it


def trained_adapters() -> dict[str, str] | None:
    """The default recipe's adapters of the default trained target (name -> path), when ``pdserve
    train-lora`` has made them."""
    from cli.train_tiny import trained_target

    base = trained_target()
    if base is None:
        return None
    done = CACHE / LoraRecipe().key(base) / "metrics.json"
    if not done.exists():
        return None
    return {name: r["path"] for name, r in json.loads(done.read_text())["adapters"].items()}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-lora",
        help="train LoRA adapters of train-tiny's model on slices of the standard library (cached)",
    )
    p.add_argument("--base", type=Path, help="the base checkpoint (default: train-tiny's target)")
    p.add_argument("--out", type=Path, help=f"output directory (default: {CACHE}/<recipe hash>)")
    p.add_argument("--corpus", type=Path, help="a directory of .py files (default: the standard library)")
    p.add_argument(
        "--slice", action="append", dest="slices", help="a package to train an adapter on (repeatable)"
    )
    p.add_argument("--steps", type=int, help="training steps per adapter (default: the recipe's)")
    p.add_argument("--force", action="store_true", help="retrain even if a finished run is cached")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = LoraRecipe()
    if args.slices:
        recipe = dataclasses.replace(recipe, slices=tuple(args.slices))
    if args.steps is not None:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    m = train_lora(recipe, args.base, args.corpus, args.out, progress=True, force=args.force)
    for name, r in m["adapters"].items():
        print(
            f"{name}: {r['path']}  validation perplexity {r['val_ppl']:.1f} (base model {r['base_val_ppl']:.1f})"
        )
    print(
        f"serve them: pdserve serve --model {m['base']} "
        + " ".join(f"--lora {n}={r['path']}" for n, r in m["adapters"].items()),
        file=sys.stderr,
    )
    return 0
