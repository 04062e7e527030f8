"""``pdserve bench`` never measures a prompt the server already saw in the same run (a prompt sent
again is a prefix-cache hit): the warm-up's prompts were the first measured requests, and every
level of a ``--sweep`` after the first re-sent the first's. Driven end to end against a fake server
that records each prompt as it comes: a level's warm-up completes before its measured requests
start, and a level before the next, so the record splits into (warm-up, measured) per level."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from cli.main import main as pdserve
from loadgen.serving_datasets import RequestSets

BLOCK = 16  # a KV block of tokens: a prefix cache hits on whole blocks from the prompt's start


def _blocks(prompts: list, levels: int, warmup: int, n: int) -> list[tuple[list, list]]:
    size = warmup + n
    assert len(prompts) == levels * size
    return [
        (prompts[k * size : k * size + warmup], prompts[k * size + warmup : (k + 1) * size])
        for k in range(levels)
    ]


def _opening(prompt: str | list[int]) -> str | tuple[int, ...]:
    """What a prefix cache could reuse: a token prompt's first block, a text prompt whole."""
    return prompt if isinstance(prompt, str) else tuple(prompt[:BLOCK])


def _bench(server, *flags: str) -> None:
    assert (
        pdserve(["bench", "--base-url", server.base_url, "--output-len", "2", "--no-progress", *flags]) == 0
    )


def _sharegpt(tmp_path, conversations: int) -> str:
    path = tmp_path / "sharegpt.json"
    turns = [
        {
            "conversations": [
                {"from": "human", "value": f"question {k}?"},
                {"from": "gpt", "value": "an answer"},
            ]
        }
        for k in range(conversations)
    ]
    path.write_text(json.dumps(turns))
    return str(path)


def test_the_warmup_prompts_are_not_measured_again(fake_server):
    _bench(fake_server, "--num-prompts", "6", "--input-len", "32")  # the default --warmup 2
    [(warmup, measured)] = _blocks(fake_server.prompts, 1, 2, 6)
    assert not {_opening(p) for p in warmup} & {_opening(p) for p in measured}


@pytest.mark.parametrize("dataset", ["random", "prefix", "sharegpt"])
def test_each_sweep_level_measures_prompts_of_its_own(fake_server, tmp_path, dataset):
    flags = [
        "--dataset",
        dataset,
        "--sweep",
        "1,2,3",
        "--num-prompts",
        "4",
        "--warmup",
        "1",
        "--input-len",
        "20",
    ]
    flags += ["--num-prefixes", "2", "--prefix-len", str(BLOCK), "--suffix-len", "4"]
    if dataset == "sharegpt":
        flags += ["--dataset-path", _sharegpt(tmp_path, 13)]  # 3 levels of 4 and the warm-up's 1
    _bench(fake_server, *flags)
    levels = _blocks(fake_server.prompts, 3, 1, 4)
    seen = {_opening(p) for warmup, _ in levels for p in warmup}
    for _, measured in levels:
        level = {_opening(p) for p in measured}
        assert not level & seen  # neither a warm-up's nor an earlier level's
        seen |= level
    if dataset != "prefix":  # (a prefix level's requests share their tenants' prefixes, as meant)
        assert len(seen) == 1 + 3 * 4


def test_a_sharegpt_file_too_small_to_keep_the_sets_apart_says_so(tmp_path, caplog):
    args = SimpleNamespace(
        dataset="sharegpt",
        dataset_path=_sharegpt(tmp_path, 5),
        tokenizer=None,
        seed=0,
        num_prompts=4,
        warmup=2,
    )
    with caplog.at_level(logging.WARNING, logger="loadgen.serving_datasets"):
        sets = RequestSets(args)
        assert len(sets.level(0)) == 4 and len(sets.warmup()) == 2
    assert "holds 5 conversations" in caplog.text and "prompts repeat" in caplog.text
