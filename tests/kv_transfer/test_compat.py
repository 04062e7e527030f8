"""KV compatibility records: stable hashes, and errors that name every mismatched field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from engine.kv_cache import KVLayout
from kv_transfer import KVCompat, KVIncompatibleError, check_compatible

BASE = KVCompat(model="llama-32m", dtype="float32", block_size=16, num_layers=8, num_kv_heads=4, head_dim=64)


def test_hash_is_stable_across_processes_and_instances():
    again = KVCompat(
        model="llama-32m", dtype="float32", block_size=16, num_layers=8, num_kv_heads=4, head_dim=64
    )
    assert BASE.hash() == again.hash()
    assert len(BASE.hash()) == 64 and int(BASE.hash(), 16) >= 0
    code = (
        "from kv_transfer import KVCompat; print(KVCompat(model='llama-32m', dtype='float32', block_size=16,"
        " num_layers=8, num_kv_heads=4, head_dim=64).hash())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == BASE.hash()


def test_every_field_changes_the_hash():
    changed = {
        "model": "other",
        "dtype": "bfloat16",
        "block_size": 32,
        "layout": "layer_major",
        "num_layers": 9,
        "num_kv_heads": 8,
        "head_dim": 128,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(KVCompat)}
    hashes = {dataclasses.replace(BASE, **{k: v}).hash() for k, v in changed.items()}
    assert len(hashes) == len(changed) and BASE.hash() not in hashes


def test_compatible_passes():
    check_compatible(BASE, dataclasses.replace(BASE))


def test_mismatch_names_every_field():
    remote = KVCompat(
        model="qwen", dtype="bfloat16", block_size=32, layout="v2", num_layers=2, num_kv_heads=1, head_dim=8
    )
    with pytest.raises(KVIncompatibleError) as err:
        check_compatible(BASE, remote, peer="prefill-0")
    msg = str(err.value)
    assert msg.startswith("cannot pull KV from worker prefill-0: ")
    for part in (
        "model llama-32m != qwen",
        "dtype float32 != bfloat16",
        "block_size 16 != 32",
        "layout block_major_v1 != v2",
        "num_layers 8 != 2",
        "num_kv_heads 4 != 1",
        "head_dim 64 != 8",
    ):
        assert part in msg
    assert isinstance(err.value, ValueError)


def test_single_mismatch_names_only_that_field():
    with pytest.raises(KVIncompatibleError, match=r"worker: dtype float32 != bfloat16$"):
        check_compatible(BASE, dataclasses.replace(BASE, dtype="bfloat16"))


def test_from_layout_matches_the_engine_layout():
    layout = KVLayout(num_layers=8, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    assert KVCompat.from_layout("llama-32m", layout) == BASE
    bf16 = KVCompat.from_layout("llama-32m", dataclasses.replace(layout, dtype=torch.bfloat16))
    assert bf16.dtype == "bfloat16"


@pytest.mark.parametrize(
    "field,value", [("block_size", 0), ("head_dim", -1), ("model", ""), ("num_layers", 1.5)]
)
def test_invalid_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(BASE, **{field: value})
