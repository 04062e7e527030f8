"""A steady decode batch on the engine channel (``worker.engine_channel.SteadyBatchSender`` and
``SteadyBatchReceiver``): its members cross once, then each step sends the batch's id and its
tokens. What the worker reads back must be what ``EngineCore.step()`` returns, step by step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.scheduler_output import PlainTokens
from proto import pdserve_pb2 as pb
from worker.engine_channel import (
    FrameBuffer,
    SteadyBatchReceiver,
    SteadyBatchSender,
    frame,
    outputs_from_proto,
    outputs_to_proto,
)


def _key(o):
    return (o.request_id, o.sample_index)


def _requests(core: EngineCore, t: int) -> None:
    """Lean requests of staggered lengths, and two more arriving while the first ones decode."""
    if t == 0:
        for i in range(5):
            params = SamplingParams(
                temperature=0.7 if i == 2 else 0, seed=i, max_tokens=9 + 4 * i, ignore_eos=True
            )
            core.add_request(f"r{i}", [5 + i, 9, 14, 3, 7, 22, 8][: 3 + i], params)
    elif t == 12:
        for i in range(5, 7):
            core.add_request(
                f"r{i}", [11, 4, 19, 30, i], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            )


def test_a_steady_batch_crosses_as_its_id_and_tokens_and_reads_back_as_the_steps_outputs(tiny_llama):
    returned = []
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=128))
    for t in range(200):
        _requests(core, t)
        if t > 12 and not core.has_unfinished():
            break
        returned.append(sorted(core.step(), key=_key))

    received, sent = [], []
    sender, receiver = SteadyBatchSender(), SteadyBatchReceiver()
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=128))
    free = core.kv.num_free_blocks
    for t in range(len(returned)):
        _requests(core, t)
        plain = PlainTokens()
        events = pb.EngineEvents()
        outputs_to_proto(core.step(plain), events, plain, None, sender)
        (back,) = FrameBuffer(pb.EngineEvents).feed(frame(events))
        sent.append((back.tokens.batch, back.tokens.HasField("batch_members"), len(back.tokens.request_ids)))
        received.append(sorted(outputs_from_proto(back, receiver), key=_key))
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == free
    assert received == returned
    as_batch = [s for s in sent if s[0]]
    assert len(as_batch) >= 15 and all(n == 0 for _, _, n in as_batch)  # no per-request columns
    assert 2 <= sum(members for _, members, _ in as_batch) <= len(as_batch) // 3  # members sent once a batch


def test_a_batch_named_before_its_members_or_with_other_tokens_is_refused():
    receiver = SteadyBatchReceiver()
    t = pb.EngineTokens(batch=1, batch_tokens=b"\x05\x00\x00\x00")
    with pytest.raises(ValueError, match="named before its members"):
        receiver.outputs(t)
    t.batch_members.request_ids.extend(["a", "b"])
    t.batch_members.sample_index.extend([0, 0])
    t.batch_members.num_prompt_tokens.extend([3, 4])
    t.batch_members.num_cached_tokens.extend([0, 0])
    with pytest.raises(ValueError, match="1 tokens for a batch of 2"):
        receiver.outputs(t)
    events = pb.EngineEvents()
    events.tokens.CopyFrom(t)
    with pytest.raises(ValueError, match="without its receiver"):
        outputs_from_proto(events)


def test_entries_beyond_the_batch_go_as_columns():
    """``PlainTokens.batch`` names the batch whose requests the entries are; entries of other
    requests beside it (or an output after them) mean the per-request columns."""
    r, s, x = (SimpleNamespace(group_id=g, sample_index=0, prompt_len=3, num_cached_tokens=0) for g in "rsx")
    sender, receiver = SteadyBatchSender(), SteadyBatchReceiver()
    plain = PlainTokens([r, s, x], [5, 6, 7], batch=[r, s])
    events = pb.EngineEvents()
    outputs_to_proto([], events, plain, None, sender)
    assert not events.tokens.batch and list(events.tokens.request_ids) == ["r", "s", "x"]
    got = [(o.request_id, o.new_token_ids) for o in outputs_from_proto(events, receiver)]
    assert got == [("r", [5]), ("s", [6]), ("x", [7])]
