"""Disk-tier prefixes read ahead of admission (engine/kv_disk_prefetch.py): a request whose prefix is
on disk waits outside the scheduler while the disk tier's reader thread reads it into the host tier,
and the other requests keep stepping; then it runs from the host tier with the same output. Aborted
while staged, it leaves at once and nothing leaks; a record that fails its check is recomputed.

The reader thread is held (``reads_held``) so that what happens while a read is in flight does not
depend on timing.
"""

from __future__ import annotations

import random
import threading

import pytest

from engine import LLM, SamplingParams
from engine.kv_disk_tier import HEADER, _FileIO

COMMON = dict(block_size=8, num_blocks=16, max_num_seqs=2)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


@pytest.fixture
def reads_held(monkeypatch):
    """Reads on the disk tier's reader thread wait until the event is set (those at admission do not)."""
    gate = threading.Event()
    read_into = _FileIO.read_into

    def held(self, *args):
        if threading.current_thread() is self.reader:
            gate.wait(60)  # (bounded: a test waiting on a read it should not wait on fails, not hangs)
        return read_into(self, *args)

    monkeypatch.setattr(_FileIO, "read_into", held)
    yield gate
    gate.set()


def _tiered(model, host_blocks: int = 24) -> LLM:
    block_bytes = LLM(str(model), **COMMON).core.layout.block_bytes
    return LLM(
        str(model),
        kv_host_cache_gib=host_blocks * block_bytes / 2**30,
        kv_disk_cache_gib=100 * (block_bytes + HEADER.size) / 2**30,
        **COMMON,
    )


def _run(core, rid: str) -> list[int]:
    """Step until ``rid`` ends; its tokens."""
    tokens: list[int] = []
    while True:
        for out in core.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens


def _on_disk(llm: LLM, prompts) -> list[int]:
    """Round 1 over ``prompts`` pushes the first ones' blocks down to the disk tier."""
    llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.core.kv.disk_blocks.flush()
    return prompts[0]


def test_a_request_read_ahead_waits_outside_while_others_step(tiny_llama, hf_greedy, reads_held):
    llm = _tiered(tiny_llama)
    core = llm.core
    prompt = _on_disk(llm, _prompts(6, 72, seed=7))
    core.add_request("again", prompt, PARAMS)
    assert "again" in core.prefetch and core.stats().num_waiting == 1  # staged: reads in flight
    other = _prompts(1, 40, seed=99)[0]
    core.add_request("other", other, PARAMS)
    assert _run(core, "other") == hf_greedy(tiny_llama, other, 4)  # stepped while the read waits
    assert "again" in core.prefetch and core.stats().prefix_cache_hits_disk == 0
    reads_held.set()
    assert _run(core, "again") == hf_greedy(tiny_llama, prompt, 4)
    stats = core.stats()
    assert core.prefetch.read_ahead_blocks > 0 and not core.prefetch.busy()
    assert stats.prefix_cache_hits_disk >= core.prefetch.read_ahead_blocks * 8  # counted as disk hits
    assert stats.num_free_blocks == stats.num_blocks and stats.disk_rejected_blocks == 0
    assert core.step() == []  # the next step lets go of the blocks held for its admission
    assert not core.kv.host_tier._pinned and not core.kv.disk_tier._pinned
    llm.close()


def test_aborted_while_read_ahead_leaves_at_once_and_leaks_nothing(tiny_llama, reads_held):
    llm = _tiered(tiny_llama)
    core = llm.core
    prompt = _on_disk(llm, _prompts(6, 72, seed=11))
    core.add_request("again", prompt, PARAMS)
    assert "again" in core.prefetch
    (out,) = core.abort_request("again")
    assert out.request_id == "again" and out.finish_reason == "abort"
    assert "again" not in core.prefetch and core.stats().num_waiting == 0
    core.add_request("again", prompt, PARAMS)  # its id is free again (staged again or not)
    core.abort_request("again")
    reads_held.set()
    while core.has_unfinished():  # the reads land; their blocks are published, nothing else runs
        assert core.step() == []
    host_tier = core.kv.host_tier
    assert not host_tier._pinned and not core.kv.disk_tier._pinned  # no slot left pinned or reserved
    assert core.prefetch.read_ahead_blocks > 0
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
    llm.close()


def test_a_record_read_ahead_that_fails_its_check_is_recomputed(tiny_llama, hf_greedy):
    llm = _tiered(tiny_llama)
    core = llm.core
    prompt = _on_disk(llm, _prompts(6, 72, seed=13))
    blocks = core.kv.disk_blocks
    with open(blocks.open_path, "r+b") as f:  # every record damaged
        for slot in range(blocks.num_slots):
            f.seek(slot * blocks.record_size + HEADER.size)
            f.write(b"\x7f" * 8)
    core.add_request("again", prompt, PARAMS)
    assert "again" in core.prefetch
    assert _run(core, "again") == hf_greedy(tiny_llama, prompt, 4)
    stats = core.stats()
    assert stats.disk_rejected_blocks > 0 and core.prefetch.read_ahead_blocks == 0
    assert stats.num_free_blocks == stats.num_blocks
    llm.close()


def test_a_block_dropped_between_its_read_and_its_publication(tiny_llama, hf_greedy, reads_held):
    """A block read ahead (from its queued copy, say) is forgotten by the disk tier before the read is
    published (its write failed meanwhile): the request still runs, its output unchanged."""
    llm = _tiered(tiny_llama)
    core = llm.core
    prompt = _on_disk(llm, _prompts(6, 72, seed=17))
    core.add_request("again", prompt, PARAMS)
    (staged,) = core.prefetch._staged
    core.kv.disk_tier.discard(staged.hashes[0])  # what the next spill does after a failed write
    assert not core.kv.reset_prefix_cache()  # (and no reset while tier slots are pinned)
    reads_held.set()
    assert _run(core, "again") == hf_greedy(tiny_llama, prompt, 4)
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks
    llm.close()


def test_an_adapter_of_a_staged_request_is_in_use(tiny_llama, tmp_path, reads_held):
    """A request staged for its prefix holds its adapter as a queued one does: not removed, not
    replaced under it."""
    from engine.lora.adapter import AdapterError, random_adapter
    from engine.models.loader import load_hf_config, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(tiny_llama))
    path = random_adapter(tmp_path / "a", spec, rank=4, seed=5, scale=0.5)
    block_bytes = LLM(str(tiny_llama), **COMMON).core.layout.block_bytes
    llm = LLM(
        str(tiny_llama),
        kv_host_cache_gib=24 * block_bytes / 2**30,
        kv_disk_cache_gib=100 * (block_bytes + HEADER.size) / 2**30,
        lora_modules={"a": str(path)},
        **COMMON,
    )
    core = llm.core
    prompts = _prompts(6, 72, seed=19)
    with_adapter = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, lora="a")
    llm.generate(prompts, with_adapter, use_tqdm=False)
    core.kv.disk_blocks.flush()
    core.add_request("again", prompts[0], with_adapter)
    assert "again" in core.prefetch
    with pytest.raises(AdapterError, match="in use"):
        core.remove_lora("a")
    reads_held.set()
    _run(core, "again")
    core.step()
    core.remove_lora("a")  # free once nothing of it is left
    llm.close()
