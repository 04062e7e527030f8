"""pdserve train-tiny, at toy scale: the training code runs a few steps on a small corpus, the pair
saves as Hugging Face checkpoints that transformers and the engine load, with one tokenizer; a
finished run is reused; validation files are held out by name."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest

from cli.train_tiny import Recipe, corpus_files, split, train_tiny

TOY = Recipe(
    vocab_size=400,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    seq_len=32,
    batch_size=2,
    steps=4,
    draft_steps=2,
    warmup=2,
    val_every=3,
)


def _corpus(tmp_path: Path) -> Path:
    src = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path / "corpus"
    root.mkdir()
    for name in (
        "bisect.py",
        "colorsys.py",
        "keyword.py",
        "glob.py",
        "fnmatch.py",
        "shlex.py",
        "this.py",
        "abc.py",
    ):
        shutil.copy(src / name, root / name)
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("assert False\n")
    return root


def test_toy_training_saves_a_pair_the_engine_loads(tmp_path):
    import transformers

    from engine import LLM, SamplingParams

    corpus = _corpus(tmp_path)
    files = corpus_files(corpus)
    assert all("tests" not in p.parts for p in files) and len(files) == 8
    train_files, val_files = split(files, TOY.val_every)
    assert val_files and train_files and not set(train_files) & set(val_files)
    m = train_tiny(TOY, tmp_path / "out", corpus, progress=False)
    for name, layers in (("target", 2), ("draft", 1)):
        r = m[name]
        assert math.isfinite(r["val_loss"]) and r["val_ppl"] == math.exp(r["val_loss"])
        model = transformers.AutoModelForCausalLM.from_pretrained(r["path"])
        assert model.config.num_hidden_layers == layers and model.config.vocab_size == TOY.vocab_size
    target_tok = json.loads((Path(m["target"]["path"]) / "tokenizer.json").read_text())
    draft_tok = json.loads((Path(m["draft"]["path"]) / "tokenizer.json").read_text())
    assert target_tok == draft_tok  # one tokenizer for the pair
    out = LLM(m["target"]["path"], num_blocks=64, block_size=8).generate(
        "def f(", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5
    # A finished run is reused, not trained again.
    stamp = (tmp_path / "out" / "metrics.json").stat().st_mtime_ns
    assert train_tiny(TOY, tmp_path / "out", corpus, progress=False) == m
    assert (tmp_path / "out" / "metrics.json").stat().st_mtime_ns == stamp
    # Asked otherwise, it is refused, not returned as the run asked for (it was, whatever changed).
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    with pytest.raises(ValueError, match="holds a run trained with another recipe: --force retrains"):
        train_tiny(dataclasses.replace(TOY, seed=5), tmp_path / "out", corpus, progress=False)
    with pytest.raises(ValueError, match="holds a run trained with another corpus"):
        train_tiny(TOY, tmp_path / "out", other, progress=False)
    with pytest.raises(ValueError, match=r"--corpus .*nowhere: no such directory"):
        train_tiny(TOY, tmp_path / "out", tmp_path / "nowhere", progress=False)
    assert m["corpus"] == str(corpus.resolve()) and m["recipe"]["seed"] == 0


def test_the_recipe_key_names_the_recipe():
    assert Recipe().key() == Recipe().key() != Recipe(steps=1).key()
