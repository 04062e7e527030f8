"""The decode worker's messages: what the engine produced while the stream was not looking goes out
as one chunk (tokens in order, greedy output unchanged), and every Finished carries the worker's
hop timing — the KV transfer when the KV was pulled, the queue and the first step always; the
prefill worker reports its queue and compute. No clock is left behind."""

from __future__ import annotations

import asyncio

import test_decode_worker as dw
from test_decode_worker import BLOCK, GREEDY, _prompt, wait_until

from decode_worker.service import DecodeService
from decode_worker.stream_output import merge_outputs
from engine import SamplingParams
from engine.scheduler_output import SequenceOutput
from prefill_worker.service import PrefillService
from proto import pdserve_pb2 as pb
from proto.convert import params_to_proto

make_pair = dw.make_pair  # the fixture: started prefill and decode workers on one in-process fabric


def test_merge_outputs_joins_each_samples_outputs():
    outs = [  # n = 2: the engine interleaves the samples step by step
        SequenceOutput("r", 0, [1], [{1: -0.1}]),
        SequenceOutput("r", 1, [9], [{9: -0.9}]),
        SequenceOutput("r", 0, [2], [{2: -0.2}]),
        SequenceOutput("r", 1, [10], [{10: -1.0}], finish_reason="length"),
        SequenceOutput("r", 1, [], error="boom", finish_reason="error"),
    ]
    merged = merge_outputs(outs)
    assert [(m.sample_index, m.new_token_ids, m.finish_reason) for m in merged] == [
        (0, [1, 2], None),
        (1, [9, 10], "length"),
        (1, [], "error"),
    ]
    assert merged[0].new_logprobs == [{1: -0.1}, {2: -0.2}]
    assert outs[0].new_token_ids == [1]  # the inputs are left as they were
    assert merge_outputs(outs[:1]) == outs[:1]


def test_a_stream_that_fell_behind_catches_up_in_one_output(make_pair):
    pair = make_pair()
    prompt = _prompt(5, 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run():
        alone = [t async for out in pair.d.decode("alone", prompt, params) for t in out.new_token_ids]
        stream = pair.d.decode("r", prompt, params)
        first = await anext(stream)

        async def engine_done() -> bool:
            return (await pair.d.stats()).num_running == 0

        await wait_until(engine_done, "the engine to finish the request")
        rest = [out async for out in stream]
        assert len(rest) == 1 and rest[0].finish_reason == "length"
        assert first.new_token_ids + rest[0].new_token_ids == alone
        await pair.wait_all_free()

    asyncio.run(run())


def _fields(t: pb.HopTiming) -> dict[str, float]:
    return {fd.name: v for fd, v in t.ListFields()}


def test_finished_carries_each_workers_hop_timing(make_pair):
    pair = make_pair()
    prompt = _prompt(3 * BLOCK + 1, 2)
    req = dict(prompt_token_ids=prompt, params=params_to_proto(GREEDY))

    async def run():
        presp = await PrefillService(pair.p).Prefill(pb.PrefillRequest(request_id="r", **req), None)
        assert set(_fields(presp.timing)) == {"prefill_queue_ms", "prefill_compute_ms"}
        assert all(v >= 0 for v in _fields(presp.timing).values())
        handle = presp.handle
        handle.address = "prefill-0:1"
        dreq = pb.DecodeRequest(request_id="r", handle=handle, **req)
        msgs = [m async for m in DecodeService(pair.d).Decode(dreq, None)]
        fin = [m.finished for m in msgs if m.HasField("finished")]
        assert len(fin) == 1
        assert set(_fields(fin[0].timing)) == {"kv_transfer_ms", "decode_queue_ms", "decode_first_step_ms"}
        assert all(v >= 0 for v in _fields(fin[0].timing).values())
        # Aggregated (no handle): no transfer.
        msgs = [m async for m in DecodeService(pair.d).Decode(pb.DecodeRequest(request_id="a", **req), None)]
        fin = [m.finished for m in msgs if m.HasField("finished")]
        assert set(_fields(fin[0].timing)) == {"decode_queue_ms", "decode_first_step_ms"}
        # Its first chunk carries the prompt's cache hit (the blocks pulled for "r"), no later one.
        chunks = [m.tokens for m in msgs if m.HasField("tokens")]
        assert [c.HasField("cached_tokens") for c in chunks] == [True] + [False] * (len(chunks) - 1)
        assert chunks[0].cached_tokens == fin[0].usage.cached_tokens == 3 * BLOCK
        await pair.wait_all_free()
        assert len(pair.d.clocks) == 0 and len(pair.p.clocks) == 0

    asyncio.run(run())
