"""prefill_hold_steps: a new prompt waits up to N pure-decode steps for others to join it, so a GPU
replays more decode steps from its graphs and computes the prompts of one interval in one mixed step.
Output is unchanged; the hold never applies when nothing decodes, when the step is mixed anyway, or
when the waiting prompts would take every free sequence slot."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _core(model, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), block_size=8, num_blocks=64, **kw))


def _step(core: EngineCore, out: dict) -> None:
    for o in core.step():
        out.setdefault(o.request_id, []).extend(o.new_token_ids)


def _staggered(core: EngineCore) -> tuple[dict, list[int]]:
    """Three requests arriving one step apart while the first decodes; returns the outputs and, per
    step, how many prompts were still waiting after it."""
    out: dict[str, list[int]] = {}
    waiting = []
    core.add_request("a", list(range(10, 30)), GREEDY)
    _step(core, out)  # nothing decodes yet: a's prompt is computed at once
    assert "a" in out
    for i, rid in enumerate(("b", "c")):
        core.add_request(rid, list(range(40 + i, 57 + i)), GREEDY)
        _step(core, out)
        waiting.append(len(core.scheduler.waiting))
    while core.has_unfinished():
        _step(core, out)
        waiting.append(len(core.scheduler.waiting))
    return out, waiting


def test_prompts_wait_for_each_other_and_output_is_unchanged(tiny_llama):
    plain, held = _core(tiny_llama, prefill_hold_steps=0), _core(tiny_llama, prefill_hold_steps=3)
    expected, waiting_plain = _staggered(plain)
    got, waiting_held = _staggered(held)
    assert got == expected and all(len(v) == 12 for v in got.values())
    assert waiting_plain[:3] == [0, 0, 0]  # each prompt computed in the step after it arrived
    # b waits (1), c joins it (2), one more held step (2), then both are computed in one step (0).
    assert waiting_held[:4] == [1, 2, 2, 0]
    for core in (plain, held):
        assert core.stats().num_free_blocks == 64


def test_no_hold_when_the_waiting_prompts_take_every_free_slot(tiny_llama):
    core, out = _core(tiny_llama, prefill_hold_steps=5, max_num_seqs=2), {}
    core.add_request("a", list(range(10, 30)), GREEDY)
    _step(core, out)
    core.add_request("b", list(range(40, 57)), GREEDY)
    _step(core, out)  # one waiting prompt, one free slot: nothing to wait for
    assert not core.scheduler.waiting and "b" in core.scheduler.requests
    assert core.scheduler.requests["b"].num_computed_tokens > 0
    while core.has_unfinished():
        _step(core, out)
    assert core.stats().num_free_blocks == 64


def test_a_prompt_chunk_in_progress_admits_waiting_prompts_at_once(tiny_llama):
    """A step already mixed (a's prompt is chunked over several steps) costs nothing more for b."""
    core, out = _core(tiny_llama, prefill_hold_steps=5, max_num_batched_tokens=24), {}
    core.add_request("z", [7, 8, 9], GREEDY)
    _step(core, out)  # z decodes from here on
    core.add_request("a", list(range(10, 50)), GREEDY)  # 40 tokens: two chunks of <= 23 beside z
    for _ in range(5):  # held: z decodes alone
        _step(core, out)
        assert core.scheduler.requests["a"].num_computed_tokens == 0
    _step(core, out)  # the hold ends: a's first chunk
    assert 0 < core.scheduler.requests["a"].num_computed_tokens < 40
    core.add_request("b", list(range(60, 66)), GREEDY)
    _step(core, out)  # a's next chunk makes the step mixed: b joins it
    assert core.scheduler.requests["b"].num_computed_tokens > 0
    while core.has_unfinished():
        _step(core, out)
    assert core.stats().num_free_blocks == 64


def test_default_is_off_without_decode_graphs(tiny_llama):
    assert _core(tiny_llama).scheduler.prefill_hold_steps == 0  # CPU: no graphs to keep
    assert _core(tiny_llama, prefill_hold_steps=2).scheduler.prefill_hold_steps == 2
    with pytest.raises(ValueError, match="prefill_hold_steps"):
        EngineConfig(model=str(tiny_llama), prefill_hold_steps=-1)
