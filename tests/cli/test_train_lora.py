"""pdserve train-lora, at toy scale: adapters trained on two slices (packages) of a small corpus from
a toy base model, saved in PEFT's format; the engine serves them with the same greedy output as HF
transformers + peft; a finished run is reused."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest
from test_train_tiny import TOY

from cli.train_lora import LoraRecipe, slice_files, train_lora
from cli.train_tiny import corpus_files, train_tiny

TOY_LORA = LoraRecipe(
    slices=("pkg_a", "pkg_b"), rank=2, alpha=4.0, steps=3, seq_len=32, batch_size=2, warmup=1, val_every=2
)


def _corpus(tmp_path: Path) -> Path:
    src = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path / "corpus"
    for package, names in (
        ("pkg_a", ("bisect.py", "colorsys.py", "keyword.py")),
        ("pkg_b", ("glob.py", "fnmatch.py", "shlex.py")),
        ("", ("this.py", "abc.py")),
    ):
        (root / package).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(src / name, root / package / name)
    return root


def test_toy_adapters_train_save_and_serve(tmp_path, hf_lora_greedy):
    from engine import LLM, SamplingParams

    corpus = _corpus(tmp_path)
    assert [p.name for p in slice_files(corpus_files(corpus), corpus, "pkg_a")] == [
        "bisect.py",
        "colorsys.py",
        "keyword.py",
    ]
    base = Path(train_tiny(TOY, tmp_path / "base", corpus, progress=False)["target"]["path"])
    m = train_lora(TOY_LORA, base, corpus, tmp_path / "lora", progress=False)
    assert set(m["adapters"]) == {"pkg_a", "pkg_b"}
    for r in m["adapters"].values():
        assert math.isfinite(r["val_loss"]) and math.isfinite(r["base_val_loss"]) and r["train_tokens"] > 0
        config = json.loads((Path(r["path"]) / "adapter_config.json").read_text())
        assert config["r"] == 2 and len(config["target_modules"]) == 7
    adapters = {n: r["path"] for n, r in m["adapters"].items()}
    llm = LLM(str(base), num_blocks=64, block_size=8, lora_modules=adapters)
    prompt = list(range(5, 25))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name, path in adapters.items():
        got = llm.generate([prompt], params, lora=name, use_tqdm=False)[0].outputs[0].token_ids
        assert got == hf_lora_greedy(base, Path(path), prompt, 8), name
    # A finished run is reused, not retrained.
    stamp = (tmp_path / "lora" / "metrics.json").stat().st_mtime_ns
    assert train_lora(TOY_LORA, base, corpus, tmp_path / "lora", progress=False) == m
    assert (tmp_path / "lora" / "metrics.json").stat().st_mtime_ns == stamp
    # Asked for with another corpus or base, the run is refused rather than returned as theirs.
    with pytest.raises(ValueError, match="holds a run trained with another base"):
        train_lora(TOY_LORA, tmp_path / "base" / "draft", corpus, tmp_path / "lora", progress=False)
    with pytest.raises(ValueError, match="no such directory"):
        train_lora(TOY_LORA, base, tmp_path / "nowhere", tmp_path / "lora", progress=False)
    with pytest.raises(ValueError, match="--base /nowhere/model: no such directory"):
        train_lora(TOY_LORA, Path("/nowhere/model"), corpus, tmp_path / "lora2", progress=False)
