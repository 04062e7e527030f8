"""``stream_interval``: a Decode stream holds a sample's tokens until that many wait. The first token
and the last (with its finish reason) never wait, errors stand alone, a quiet stream sends what it
holds instead of a bare keepalive, and the tokens are the engine's, in order, whatever the interval."""

from __future__ import annotations

import asyncio
import threading

import pytest
import test_decode_worker as dw
from test_decode_worker import _prompt, wait_until

from decode_worker.stream_output import StreamInterval
from decode_worker.worker import Progress
from engine import SamplingParams
from engine.scheduler_output import SequenceOutput

make_pair = dw.make_pair  # the fixture: started prefill and decode workers on one in-process fabric
engine_alone = dw.engine_alone
PARAMS = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def _out(tokens, sample=0, finish=None, error=None) -> SequenceOutput:
    return SequenceOutput("r", sample, list(tokens), finish_reason=finish, error=error)


def _shape(outs) -> list[tuple[int, list[int], str | None]]:
    return [(o.sample_index, o.new_token_ids, o.finish_reason) for o in outs]


def test_the_first_token_goes_at_once_then_tokens_wait_for_the_interval():
    hold = StreamInterval(3)
    assert _shape(hold.release([_out([1])])) == [(0, [1], None)]
    assert hold.release([_out([2])]) == [] and hold.release([_out([3])]) == []
    assert _shape(hold.release([_out([4])])) == [(0, [2, 3, 4], None)]
    assert hold.release([_out([5])]) == []
    assert _shape(hold.release([_out([6], finish="length")])) == [(0, [5, 6], "length")]
    assert hold.flush() == []


def test_samples_are_held_apart_and_a_quiet_stream_flushes_them():
    hold = StreamInterval(4, first_sent=True)  # after a hand-off: the first token went out already
    assert hold.release([_out([1], 0), _out([9], 1)]) == []
    assert _shape(hold.release([_out([2, 3, 4], 0), _out([10], 1)])) == [(0, [1, 2, 3, 4], None)]
    assert _shape(hold.flush()) == [(1, [9, 10], None)]
    assert hold.flush() == []


def test_an_error_stands_alone_after_what_was_held():
    hold = StreamInterval(4, first_sent=True)
    hold.release([_out([1])])
    assert _shape(hold.release([_out([], finish="error", error="boom")])) == [
        (0, [1], None),
        (0, [], "error"),
    ]


def test_an_interval_of_one_sends_everything_as_it_comes():
    outs = [_out([1]), _out([2])]
    assert StreamInterval(1).release(outs) is outs
    with pytest.raises(ValueError, match="at least 1"):
        StreamInterval(0)


def test_a_stream_sends_interval_tokens_per_message_and_the_engines_tokens(make_pair, engine_alone):
    pair = make_pair(stream_interval=4)
    prompt = _prompt(5, 7)

    async def run():
        msgs = [out.new_token_ids async for out in pair.d.decode("local", prompt, PARAMS)]
        assert [t for m in msgs for t in m] == engine_alone(prompt, PARAMS)
        assert len(msgs[0]) >= 1 and all(len(m) >= 4 for m in msgs[1:-1]), msgs
        assert len(msgs) <= 1 + -(-(PARAMS.max_tokens - 1) // 4)

        kv = await pair.prefill("handed", prompt, PARAMS)  # the first token came from the prefill side
        msgs = [out.new_token_ids async for out in pair.d.decode("handed", prompt, PARAMS, kv=kv)]
        assert [kv.first_token, *(t for m in msgs for t in m)] == engine_alone(prompt, PARAMS)
        assert all(len(m) >= 4 for m in msgs[:-1]), msgs
        await pair.wait_all_free()

    asyncio.run(run())


def test_a_quiet_stream_sends_its_held_tokens_not_just_a_keepalive(make_pair, engine_alone):
    pair = make_pair(stream_interval=1000)  # nothing would go out before the end but for the flush
    prompt = _prompt(6, 5)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)  # still running when blocked
    release = threading.Event()

    async def produced() -> int:
        reqs = pair.d.core.scheduler.requests.values()
        return await pair.d.loop.run(lambda: sum(r.num_output_tokens for r in reqs if r.group_id == "r"))

    async def run():
        stream = pair.d.decode("r", prompt, params, keepalive_s=0.05)
        first = await anext(stream)
        assert len(first.new_token_ids) >= 1

        async def some_held() -> bool:
            return await produced() >= len(first.new_token_ids) + 2

        await wait_until(some_held, "the engine to produce tokens the stream holds")
        pair.d.loop.call(release.wait)  # the engine thread blocks: the stream goes quiet
        try:
            quiet = await anext(stream)
        finally:
            release.set()
        assert not isinstance(quiet, Progress) and quiet.finish_reason is None
        assert len(quiet.new_token_ids) >= 2
        rest = [out for out in [x async for x in stream] if not isinstance(out, Progress)]
        tokens = first.new_token_ids + quiet.new_token_ids + [t for o in rest for t in o.new_token_ids]
        assert tokens == engine_alone(prompt, params)
        await pair.wait_all_free()

    asyncio.run(run())
