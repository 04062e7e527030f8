"""``EngineCore.step(plain)``: a lean request's token that does not end it goes into the step's
``PlainTokens`` columns instead of an output object (the engine process sends those as columns).
The same requests stepped both ways give the same outputs step by step (``plain.outputs()`` in
place of the objects), the same token counts, and every block back."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.scheduler_output import PlainTokens

REQUESTS = [
    ([5, 9, 14, 3, 7, 22, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ([11, 4, 4, 19, 30], SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)),
    ([2, 6, 40, 41, 42, 43], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)),
    ([17, 18, 19], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True)),
    ([9, 8, 7, 6, 5, 4, 3, 2, 1], SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[17, 40])),
]


def _steps(model, overlap: bool, columns: bool) -> tuple[list[list], int]:
    core = EngineCore(
        EngineConfig(
            model=str(model), block_size=4, num_blocks=96, async_scheduling="on" if overlap else "off"
        )
    )
    free = core.kv.num_free_blocks
    for i, (prompt, params) in enumerate(REQUESTS):
        core.add_request(f"r{i}", prompt, params)
    steps = []
    while core.has_unfinished():
        if columns:
            plain = PlainTokens()
            outs = plain.merged(core.step(plain))
        else:
            outs = core.step()
        steps.append(sorted(outs, key=lambda o: (o.request_id, o.sample_index)))
    assert core.kv.num_free_blocks == free
    return steps, core.stats().generation_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_columns_give_the_outputs_the_objects_did(tiny_llama, overlap):
    objects, n_objects = _steps(tiny_llama, overlap, columns=False)
    columns, n_columns = _steps(tiny_llama, overlap, columns=True)
    assert columns == objects
    assert n_columns == n_objects == sum(len(o.new_token_ids) for step in objects for o in step)
    assert sum(1 for step in objects for o in step if o.finish_reason == "length") >= 4


def test_only_plain_tokens_become_columns(tiny_llama):
    """A finishing token, logprobs and parallel samples keep their whole outputs."""
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=96))
    for i, (prompt, params) in enumerate(REQUESTS):
        core.add_request(f"r{i}", prompt, params)
    seen_plain = set()
    while core.has_unfinished():
        plain = PlainTokens()
        for out in core.step(plain):  # a lean request's whole output is its last
            assert out.finish_reason is not None or out.request_id in ("r2", "r3"), out
        assert {r.group_id for r in plain.requests}.isdisjoint({"r2", "r3"})
        seen_plain.update(r.group_id for r in plain.requests)
    assert seen_plain == {"r0", "r1", "r4"}


@pytest.mark.parametrize("columns", [False, True])
def test_a_stop_in_the_step_in_flight_then_a_step_that_needs_host_tokens(tiny_model_factory, columns):
    """Overlapped steps; the step in flight samples r's stop token while the next step, already
    scheduled with r among its decodes, cannot overlap (a penalised prompt arrives, too long to
    sample this step): r ends before that step's samples come back, and the runner still samples
    it there. Its request is gone from the scheduler by then; the step goes on without it (it once
    raised KeyError, failing every request)."""
    model = tiny_model_factory("llama", weight_scale=4.0, randomize_all=True)

    def core() -> EngineCore:
        return EngineCore(
            EngineConfig(
                model=str(model),
                block_size=4,
                num_blocks=64,
                max_num_batched_tokens=16,
                async_scheduling="on",
            )
        )

    alone = core()
    alone.add_request("r", [7, 11, 19, 23], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = []
    while alone.has_unfinished():
        tokens += [t for o in alone.step() for t in o.new_token_ids]
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    for add_at in range(1, 12):
        engine = core()
        free = engine.kv.num_free_blocks
        engine.add_request(
            "a", [5, 9, 13, 17, 21], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )
        engine.add_request(
            "r", [7, 11, 19, 23], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[k]])
        )
        got: dict[str, list[int]] = {}
        for i in range(80):
            if i == add_at:
                engine.add_request(
                    "x", list(range(30, 70)), SamplingParams(max_tokens=3, repetition_penalty=1.2)
                )
            if not engine.has_unfinished():
                break
            plain = PlainTokens() if columns else None
            outs = plain.merged(engine.step(plain)) if plain is not None else engine.step()
            for o in outs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert not engine.has_unfinished() and engine.kv.num_free_blocks == free
        assert got["r"] == tokens[: k + 1], f"add_at={add_at}"
