"""Block hashes: the keys that let any engine (and the router) recognise a cached prefix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_hash import hash_block, hash_blocks, hash_next_block, hash_next_blocks, root_hash
from engine.request import Request
from engine.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
BS = 4
TOKENS = list(range(100, 100 + 4 * BS + 2))  # four full blocks and a partial one


def test_each_block_hash_depends_on_every_earlier_block() -> None:
    base = hash_blocks(TOKENS, BS)
    for changed_block in range(4):
        tokens = list(TOKENS)
        tokens[changed_block * BS] += 1
        other = hash_blocks(tokens, BS)
        assert other[:changed_block] == base[:changed_block]
        # The changed block and everything after it get new keys: a suffix never matches on its own.
        assert all(a != b for a, b in zip(other[changed_block:], base[changed_block:]))


def test_same_block_tokens_after_different_prefixes_hash_differently() -> None:
    block = [1, 2, 3, 4]
    a = hash_blocks([9, 9, 9, 9, *block], BS)
    b = hash_blocks([8, 8, 8, 8, *block], BS)
    assert a[1] != b[1]


def test_hashes_are_the_chain_of_hash_block_from_the_root() -> None:
    expected, parent = [], root_hash("")
    for i in range(4):
        parent = hash_block(parent, TOKENS[i * BS : (i + 1) * BS])
        expected.append(parent)
    assert hash_blocks(TOKENS, BS) == expected
    assert all(isinstance(h, bytes) and len(h) == 16 for h in expected)


def test_hashes_are_identical_in_another_process() -> None:
    code = (
        "from engine.block_hash import hash_blocks; "
        f"print(','.join(h.hex() for h in hash_blocks({TOKENS!r}, {BS}, salt='m')))"
    )
    # A different PYTHONHASHSEED makes sure Python's randomised hash() is not involved.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=env, check=True
    )
    assert proc.stdout.strip().split(",") == [h.hex() for h in hash_blocks(TOKENS, BS, salt="m")]


def test_salt_changes_the_root_and_every_block() -> None:
    assert root_hash("model-a") != root_hash("model-b") != root_hash("")
    a = hash_blocks(TOKENS, BS, salt="model-a")
    b = hash_blocks(TOKENS, BS, salt="model-b")
    assert all(x != y for x, y in zip(a, b))


def test_partial_blocks_are_not_hashed() -> None:
    assert len(hash_blocks(TOKENS, BS)) == 4
    assert hash_blocks(TOKENS[: BS - 1], BS) == []
    assert hash_blocks([], BS) == []
    # Appending tokens that do not complete a block changes nothing.
    assert hash_blocks([*TOKENS, 1], BS) == hash_blocks(TOKENS, BS)


@pytest.mark.parametrize("split", [1, 2, 3, 4])
def test_extending_a_chain_equals_recomputing_it(split: int) -> None:
    full = hash_blocks(TOKENS, BS, salt="s")
    head = hash_blocks(TOKENS[: split * BS], BS, salt="s")
    tail = hash_blocks(TOKENS, BS, salt="s", parent=head[-1], start_block=split)
    assert head + tail == full


def test_one_block_at_a_time_equals_the_chain() -> None:
    """A decode fills one block at a time (``hash_next_block``, ``Request.update_block_hashes``'s
    one-block path): the same chain as hashing the tokens at once, salt and adapter salt included."""
    tokens = [(7 * i + 3) % 1000 for i in range(70)]
    chain, parent = [], None
    for b in range(70 // 4):
        parent = hash_next_block(parent, tokens[4 * b : 4 * b + 4], "m")
        chain.append(parent)
    assert chain == hash_blocks(tokens, 4, "m")
    req = Request("r", tokens[:5], SamplingParams(max_tokens=100), seed=0, lora_salt="|a")
    req.update_block_hashes(4, "m")
    for tok in tokens[5:]:
        req.token_ids.append(tok)
        req.update_block_hashes(4, "m")
    assert req.block_hashes == hash_blocks(tokens, 4, "m|a")


def test_invalid_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        hash_blocks(TOKENS, 0)


def test_block_hash_module_does_not_import_torch() -> None:
    code = "import engine.block_hash, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr


def test_block_hash_source_imports_nothing_heavy() -> None:
    # The module's own imports are light; what pulls torch in is the package __init__.
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('bh', 'engine/block_hash.py'); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "assert 'torch' not in sys.modules and 'engine' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr


def test_many_next_blocks_at_once_equal_each_one() -> None:
    """A steady batch hashes the blocks its sequences fill in one call (``hash_next_blocks``): each
    equals ``hash_next_block`` of its own parent and tokens; a token count that is not one block
    per parent is refused."""
    parents = [hash_next_block(None, [i, i + 1, i + 2, i + 3], "m") for i in range(5)]
    blocks = [[(11 * i + j) % 997 for j in range(BS)] for i in range(5)]
    flat = [t for block in blocks for t in block]
    assert hash_next_blocks(parents, flat, BS) == [hash_next_block(p, b) for p, b in zip(parents, blocks)]
    assert hash_next_blocks([], [], BS) == []
    with pytest.raises(ValueError, match="5 blocks of 4 tokens"):
        hash_next_blocks(parents, flat[:-1], BS)
