"""A steady batch's members at a block boundary, taken in batch order when the order matters.

At a boundary one member's token fills its block (cached once full) while another's opens a
fresh one, which may evict a cached free block. With repeated content (the same prompt sent
again, greedy outputs alike), the block a member fills can hold the same hash as a free block that
another member's allocation evicts in the same step: which of the two the prefix cache keeps
depends on which of the members comes first. The per-request path takes them in batch order; the
bulk step must end with the same cache: it skips registering a filled block whose hash a free block
held until an opening after it evicted it (``SteadyDecodes._evicted_after``), caches a late block
before the next allocation (``open_blocks``), and takes the boundary members one by one in batch
order when it cannot tell otherwise (``boundary_in_order``). Each test compares the pool's hashes after every step with the per-request
path's, on workloads where the pool cycles (every allocation evicts) and content repeats.
"""

from __future__ import annotations

import random
import zlib

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.fake_runner import FakeRunner
from tests.engine.scheduler_driver import Driver
from tests.engine.test_steady_decodes import BulkCounts, _decisions


def _kind(seq_id: str) -> int:
    """Requests fall into three kinds; those of a kind have the same prompt and outputs."""
    return int(seq_id.split("#")[0][1:]) % 3


def _token(seq_id: str, position: int) -> int:
    return zlib.crc32(f"k{_kind(seq_id)}:{position}".encode()) % 50_000


def _repeats(policy: str, num_blocks: int, seed: int) -> list[tuple]:
    """Arrivals while others decode, prompts of three contents cut at random lengths; every step's
    decisions and the pool's hashes after it."""
    rng = random.Random(seed)
    d = Driver(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=40, max_num_seqs=10, policy=policy)
    d.runner.fake = FakeRunner(_token)
    steps: list[tuple] = []
    for t in range(500):
        if t < 150 and rng.random() < 0.35:
            rid = f"r{d._num_added}"
            prompt = [zlib.crc32(f"p{_kind(rid)}/{j}".encode()) % 50_000 for j in range(rng.randrange(2, 12))]
            d.add(rid, prompt, max_tokens=rng.randrange(3, 30))
        if t >= 150 and not d.sched.has_unfinished():
            break
        steps.append(_decisions(d, d.step()))
    d.assert_drained()
    return steps


# Seeds whose runs diverged: before the fix (the bulk step allocated every opening block before it
# cached any filled one), 8 of the first 12 differed in the pool's hashes at some step; with the
# fix but without its per-request fallback (a first block filled while an opening evicts), (24, 126)
# under fair. Found by this driver over 900 seeds a variant.
@pytest.mark.parametrize("policy", ["fifo", "fair", "prefill_first"])
@pytest.mark.parametrize(("num_blocks", "seed"), [(40, 1), (96, 74), (40, 88), (96, 89), (24, 126)])
def test_repeated_content_leaves_the_prefix_cache_of_the_per_request_path(
    monkeypatch, policy, num_blocks, seed
):
    with monkeypatch.context() as m:
        BulkCounts(m, enabled=False)
        want = _repeats(policy, num_blocks, seed)
    counts = BulkCounts(monkeypatch, enabled=True)
    have = _repeats(policy, num_blocks, seed)
    for i, (w, h) in enumerate(zip(want, have)):
        assert h == w, f"step {i} differs"
    assert len(have) == len(want)
    assert counts.scheduled >= 20


PROMPTS = [[3, 17, 29, 41, 5, 8, 13], [9, 4, 4, 61, 2], [77, 12, 30, 30, 6, 1, 19, 44, 3]]


def _engine_repeats(
    model, overlap: bool, num_blocks: int = 36, every: int = 2, host_gib: float = 0.0
) -> list[tuple]:
    """The engine, overlapped or not (overlapped, a filled block is cached only when the next step
    opens one: its last token was in flight), on three prompts sent again and again, greedy, in a
    pool small enough to cycle; what each step scheduled, the pool's hashes after it and, with a
    host tier (``host_gib``: the evicted blocks copied out, hits loaded back), the tier's."""
    core = EngineCore(
        EngineConfig(
            model=str(model),
            block_size=4,
            num_blocks=num_blocks,
            async_scheduling="on" if overlap else "off",
            kv_host_cache_gib=host_gib,
        )
    )
    tier = core.kv.host_tier
    free = core.kv.num_free_blocks
    steps: list[tuple] = []
    schedule = core.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append((dict(out.num_scheduled_tokens), dict(out.decode_new_blocks)))
        return out

    core.scheduler.schedule = recorded
    for t in range(1000):
        if t < 200 and t % every == 0:
            n = t // every
            params = SamplingParams(temperature=0, max_tokens=(9, 22, 14, 31, 5)[n % 5], ignore_eos=True)
            core.add_request(f"e{t}", PROMPTS[n % 3], params)
        if t >= 200 and not core.has_unfinished():
            break
        outs = core.step()
        hosted = tier.hashes() if tier is not None else []
        steps.append(
            (sorted((o.request_id, o.new_token_ids) for o in outs), list(core.kv.pool.block_hash), hosted)
        )
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == free
    return steps


@pytest.mark.parametrize("host_gib", [0.0, 0.0005], ids=["pool", "host-tier"])
@pytest.mark.parametrize("overlap", [False, True])
def test_engine_with_repeated_prompts_caches_as_the_per_request_path(
    monkeypatch, tiny_llama, overlap, host_gib
):
    with monkeypatch.context() as m:
        BulkCounts(m, enabled=False)
        want = _engine_repeats(tiny_llama, overlap, host_gib=host_gib)
    counts = BulkCounts(monkeypatch, enabled=True)
    have = _engine_repeats(tiny_llama, overlap, host_gib=host_gib)
    for i, (w, h) in enumerate(zip(want, have)):
        assert h == w, f"step {i} differs"
    assert len(have) == len(want)
    assert counts.scheduled >= 50
    if host_gib:  # the tier took evicted blocks and gave hits back
        assert max(len(step[2]) for step in have if len(step) == 3) > 4
