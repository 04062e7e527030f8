"""``pdserve train-tiny``: a small Llama that has learned something, and a matching draft, trained on
this machine from text every machine has offline: the Python standard library's own sources.

Random weights cannot show what depends on learned behaviour (a draft's tokens being accepted, the
accuracy cost of a quantized KV cache, readable demo output). This trains, with a fixed seed and a
fixed number of steps (so the same recipe gives the same model anywhere):
1. a byte-level BPE tokenizer (``tokenizers``) on the training files;
2. the target: a Llama of about 12M parameters (tied embeddings), next-token loss on random windows;
3. the draft: a 1-layer Llama with the same tokenizer and width, trained the same way.
Both are saved as Hugging Face checkpoints (``transformers`` and the engine load them) under
``~/.cache/pdserve/trained-tiny/<recipe hash>/{target,draft}``, with ``metrics.json`` (validation
loss and perplexity on files held out by name). A finished run is reused; ``--force`` retrains.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path.home() / ".cache" / "pdserve" / "trained-tiny"


@dataclass(frozen=True)
class Recipe:
    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    draft_layers: int = 1
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1400
    draft_steps: int = 800
    lr: float = 2e-3
    warmup: int = 20
    seed: int = 0
    val_every: int = 50  # files: one in this many (by name) is held out for validation
    # float32, or bfloat16 autocast: 3.7x slower per step on a CPU without bf16 instructions (a
    # 2-core AVX-512 Xeon: 3.05 s vs 0.83 s for the target at batch 8 x 256).
    precision: str = "float32"

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files (tests and third-party packages left out), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def resolve_corpus(corpus: Path | None) -> Path:
    """The corpus directory (default: this Python's standard library), which must exist."""
    root = Path(corpus or sysconfig.get_paths()["stdlib"]).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"--corpus {corpus}: no such directory")
    return root


def keyed(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def reuse(done: Path, wanted: dict, force: bool) -> dict | None:
    """A finished run's metrics when it was trained as ``wanted`` says (recipe, corpus...); None to
    train (nothing there, or ``force``). A run trained otherwise is refused, not returned as if it
    were the one asked for (a later --corpus, --steps or --seed got the first run's model). A run
    written before its corpus was recorded counts as the default corpus's."""
    if force or not done.exists():
        return None
    metrics = json.loads(done.read_text())
    metrics.setdefault("corpus", str(resolve_corpus(None)))
    differ = [k for k, v in wanted.items() if json.loads(json.dumps(v)) != metrics.get(k)]
    if differ:
        raise ValueError(
            f"{done.parent} holds a run trained with another {' and '.join(differ)}: --force retrains "
            "it there, or give another --out"
        )
    return metrics


def split(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    """(train, validation): a file is held out by a hash of its name, stable across machines."""

    def held(p: Path) -> bool:
        return int(hashlib.sha256(p.name.encode()).hexdigest(), 16) % every == 0

    return [p for p in files if not held(p)], [p for p in files if held(p)]


def encode(tokenizer, texts: list[str]):
    import torch

    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def make_model(recipe: Recipe, layers: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def train(model, data, recipe: Recipe, steps: int, desc: str, progress: bool) -> float:
    """AdamW, linear warm-up then cosine decay, on random windows of ``data``; the last loss."""
    import torch
    from tqdm.auto import tqdm

    rng = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc=desc, disable=not progress)
    for step in bar:
        lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=rng)
        batch = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts.tolist()])
        bf16 = recipe.precision == "bfloat16"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the model shifts the labels
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(loss.detach())
        bar.set_postfix(loss=f"{loss_value:.3f}")
    model.eval()
    return loss_value


def evaluate(model, data, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows of the held-out tokens (float32)."""
    import torch

    losses = []
    with torch.no_grad():
        for s in range(0, len(data) - seq_len - 1, seq_len):
            window = data[s : s + seq_len + 1][None]
            losses.append(float(model(input_ids=window, labels=window).loss))
    return sum(losses) / max(len(losses), 1)


def train_tiny(
    recipe: Recipe,
    out: Path | None = None,
    corpus: Path | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict:
    """Train (or reuse) the pair; returns the metrics (paths, validation loss and perplexity)."""
    import torch

    from engine.tiny_model import build_byte_level_tokenizer

    source = resolve_corpus(corpus)
    # The default corpus keeps the recipe's own key (the cache ``trained_target`` reads).
    out = Path(out or CACHE / (recipe.key() if corpus is None else keyed(recipe.key(), str(source))))
    wanted = {"recipe": dataclasses.asdict(recipe), "corpus": str(source)}
    done = out / "metrics.json"
    reused = reuse(done, wanted, force)
    if reused is not None:
        return reused
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    train_files, val_files = split(corpus_files(source), recipe.val_every)
    if not train_files or not val_files:
        raise ValueError(f"too few source files under {source} to train and validate")
    train_texts, val_texts = _read(train_files), _read(val_files)
    t0 = time.perf_counter()
    tokenizer = build_byte_level_tokenizer(recipe.vocab_size, train_texts, chat_template=None)
    data, val = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    metrics: dict = {
        **wanted,
        "train_tokens": len(data),
        "validation_tokens": len(val),
        "validation_files": len(val_files),
    }
    for name, layers, steps in (
        ("target", recipe.num_layers, recipe.steps),
        ("draft", recipe.draft_layers, recipe.draft_steps),
    ):
        torch.manual_seed(recipe.seed)
        model = make_model(recipe, layers)
        params = sum(p.numel() for p in model.parameters())
        last = train(model, data, recipe, steps, f"train {name} ({params / 1e6:.1f}M params)", progress)
        loss = evaluate(model, val, recipe.seq_len)
        path = out / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        metrics[name] = {
            "path": str(path),
            "params": params,
            "train_loss": last,
            "val_loss": loss,
            "val_ppl": math.exp(loss),
        }
    metrics["seconds"] = time.perf_counter() - t0
    done.write_text(json.dumps(metrics, indent=2))
    return metrics


def _read(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def trained_target() -> Path | None:
    """The default recipe's trained target, when ``pdserve train-tiny`` has made it."""
    path = CACHE / Recipe().key()
    return path / "target" if (path / "metrics.json").exists() else None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-tiny", help="train a small Llama and a draft on the Python standard library (cached)"
    )
    p.add_argument("--out", type=Path, help=f"output directory (default: {CACHE}/<recipe hash>)")
    p.add_argument(
        "--corpus", type=Path, help="a directory of .py files (default: this Python's standard library)"
    )
    p.add_argument("--steps", type=int, help="target training steps (default: the recipe's)")
    p.add_argument("--draft-steps", type=int, help="draft training steps (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="retrain even if a finished run is cached")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = Recipe(seed=args.seed)
    if args.steps is not None:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    if args.draft_steps is not None:
        recipe = dataclasses.replace(recipe, draft_steps=args.draft_steps)
    m = train_tiny(recipe, args.out, args.corpus, progress=True, force=args.force)
    for name in ("target", "draft"):
        r = m[name]
        print(
            f"{name}: {r['path']}  {r['params'] / 1e6:.1f}M params  validation loss {r['val_loss']:.3f}  perplexity {r['val_ppl']:.1f}"
        )
    print(
        f"{m['train_tokens']} training tokens, {m['validation_tokens']} validation tokens; {m.get('seconds', 0):.0f}s",
        file=sys.stderr,
    )
    return 0
