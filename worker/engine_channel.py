"""The wire between a worker and its engine process: frames, and the values they carry.

A frame is one protobuf message (``EngineCommands`` towards the engine, ``EngineEvents`` back): a
4-byte little-endian length, then the bytes. Nothing else crosses (no pickle). ``FrameBuffer``
splits what a non-blocking read returned into whole messages; ``write_frame`` writes one whole.
The rest converts the engine's values (outputs, stats, options, limits) to and from their messages.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import struct
from itertools import repeat
from typing import TypeVar

from google.protobuf.message import Message

from engine.config import EngineConfig
from engine.limits import RequestLimits
from engine.scheduler_output import PlainTokens, SequenceOutput
from kv_transfer import KVCompat, RemoteKVInfo
from kv_transfer.compat import dtype_name
from proto import pdserve_pb2 as pb
from proto.convert import logprobs_from_proto, logprobs_to_proto
from worker.state import compat_from_proto, compat_to_proto, transfer_info_from_proto

M = TypeVar("M", bound=Message)
_LEN = struct.Struct("<I")
PIPE_BYTES = 1 << 20  # each pipe's kernel buffer: a long prompt's add fits without waiting for a read


def frame(msg: Message) -> bytes:
    data = msg.SerializeToString()
    return _LEN.pack(len(data)) + data


def write_frame(fd: int, msg: Message) -> None:
    """Write one whole frame to a blocking descriptor."""
    view = memoryview(frame(msg))
    while view:
        view = view[os.write(fd, view) :]


class FrameBuffer:
    """Bytes in, whole messages of type ``kind`` out."""

    def __init__(self, kind: type[M]) -> None:
        self.kind = kind
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[M]:
        buf = self._buf
        buf += data
        out, pos = [], 0
        while len(buf) - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if len(buf) - pos - 4 < n:
                break
            msg = self.kind()
            msg.ParseFromString(bytes(buf[pos + 4 : pos + 4 + n]))
            out.append(msg)
            pos += 4 + n
        del buf[:pos]
        return out


def read_frame(fd: int, kind: type[M]) -> M | None:
    """Block until one whole frame arrived on ``fd``; None at end of file."""
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    body = _read_exactly(fd, n)
    if body is None:
        return None
    msg = kind()
    msg.ParseFromString(body)
    return msg


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# Values ---------------------------------------------------------------------------------------


def config_to_json(config: EngineConfig) -> str:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["dtype"] = dtype_name(config.dtype)
    return json.dumps(fields)


def config_from_json(text: str) -> EngineConfig:
    return EngineConfig(**json.loads(text))


class SteadyBatchSender:
    """The engine process's end of a channel: a steady decode batch's members (``PlainTokens.batch``)
    cross once, under a new id, and each later step of it sends the id and its tokens (4 bytes
    each) instead of six columns per request."""

    def __init__(self) -> None:
        self._batch: list | None = None  # the requests' list object: the same while the batch repeats
        self._id = 0

    def put(self, t: pb.EngineTokens, batch: list, tokens: list[int]) -> None:
        if batch is not self._batch:
            self._batch, self._id = batch, self._id + 1
            m = t.batch_members
            m.request_ids.extend([r.group_id for r in batch])
            m.sample_index.extend([r.sample_index for r in batch])
            m.num_prompt_tokens.extend([r.prompt_len for r in batch])
            m.num_cached_tokens.extend([c if (c := r.num_cached_tokens) > 0 else 0 for r in batch])
        t.batch = self._id
        t.batch_tokens = array.array("i", tokens).tobytes()


class SteadyBatchReceiver:
    """The worker's end: the latest steady batch's members, for the steps that name it."""

    def __init__(self) -> None:
        self._id = 0
        self._members: tuple = ((), (), (), ())

    def outputs(self, t: pb.EngineTokens) -> list[SequenceOutput]:
        if t.HasField("batch_members"):
            m = t.batch_members
            self._id = t.batch
            self._members = (
                list(m.request_ids),
                list(m.sample_index),
                list(m.num_prompt_tokens),
                list(m.num_cached_tokens),
            )
        elif t.batch != self._id:
            raise ValueError(
                f"engine channel: steady batch {t.batch} named before its members (latest {self._id})"
            )
        tokens = array.array("i")
        tokens.frombytes(t.batch_tokens)
        if len(tokens) != len(self._members[0]):
            raise ValueError(f"engine channel: {len(tokens)} tokens for a batch of {len(self._members[0])}")
        ids, samples, prompts, cached = self._members
        return [
            SequenceOutput(rid, sample, [tok], None, None, None, prompt, hit)
            for rid, sample, prompt, hit, tok in zip(ids, samples, prompts, cached, tokens)
        ]


def outputs_to_proto(
    outputs: list[SequenceOutput],
    events: pb.EngineEvents,
    columns: PlainTokens | None = None,
    positions: list[int] | None = None,
    batches: SteadyBatchSender | None = None,
) -> None:
    """Outputs into ``events``: the plain ones (new tokens only) as columns, the rest whole;
    ``columns``: plain outputs the engine kept as columns already (``EngineCore.step``), and
    ``positions``, for each of ``outputs``, how many of those precede it (None: none do). The
    message keeps that order (``output_positions``): one message can carry two steps' outputs,
    a sequence's plain token and then its finish. With ``batches`` (the channel's sender), columns
    that are a steady batch, after every output, go as that batch (``SteadyBatchSender``)."""
    t = events.tokens
    reqs, toks = (columns.requests, columns.tokens) if columns is not None else ([], [])
    at = 0  # the engine's entries sent so far
    run: list[SequenceOutput] = []  # plain objects not yet sent (sent a column at a time)
    for out, pos in zip(outputs, positions or repeat(0)):
        if pos > at:
            _put_objects(t, run)
            _put_columns(t, reqs[at:pos], toks[at:pos])
            at = pos
        if (
            out.finish_reason is None
            and out.new_logprobs is None
            and out.error is None
            and out.prompt_logprobs is None
            and out.seed is None
            and out.held_block_ids is None
        ):
            run.append(out)
        else:
            _put_objects(t, run)
            events.outputs.append(output_to_proto(out))
            events.output_positions.append(len(t.request_ids))
    _put_objects(t, run)
    batch = columns.batch if batches is not None and at == 0 and columns is not None else None
    if batch is not None and len(batch) == len(reqs):  # these entries are the batch's, all and only
        batches.put(t, batch, toks)
        return
    _put_columns(t, reqs[at:], toks[at:])


def _put_objects(t: pb.EngineTokens, plain: list[SequenceOutput]) -> None:
    if plain:
        t.request_ids.extend([o.request_id for o in plain])
        t.sample_index.extend([o.sample_index for o in plain])
        t.num_tokens.extend([len(o.new_token_ids) for o in plain])
        t.token_ids.extend([tok for o in plain for tok in o.new_token_ids])
        t.num_prompt_tokens.extend([o.num_prompt_tokens for o in plain])
        t.num_cached_tokens.extend([o.num_cached_tokens for o in plain])
        plain.clear()


def _put_columns(t: pb.EngineTokens, reqs: list, tokens: list[int]) -> None:
    if tokens:  # NOTE: every sequence, every step: a column at a time
        t.request_ids.extend([r.group_id for r in reqs])
        t.sample_index.extend([r.sample_index for r in reqs])
        t.num_tokens.extend([1] * len(reqs))
        t.token_ids.extend(tokens)
        t.num_prompt_tokens.extend([r.prompt_len for r in reqs])
        t.num_cached_tokens.extend([c if (c := r.num_cached_tokens) > 0 else 0 for r in reqs])


def outputs_from_proto(
    events: pb.EngineEvents, batches: SteadyBatchReceiver | None = None
) -> list[SequenceOutput]:
    """``outputs_to_proto`` undone, in its order (``output_positions``); ``batches``: the
    channel's receiver, for a message that carries a steady batch."""
    whole = [output_from_proto(o) for o in events.outputs]
    t = events.tokens
    plain = []
    if t.request_ids:
        tokens, pos = t.token_ids, 0
        for rid, sample, n, prompt, cached in zip(
            t.request_ids, t.sample_index, t.num_tokens, t.num_prompt_tokens, t.num_cached_tokens
        ):
            plain.append(
                SequenceOutput(rid, sample, list(tokens[pos : pos + n]), None, None, None, prompt, cached)
            )
            pos += n
    if t.batch:
        if batches is None:
            raise ValueError("engine channel: a steady batch on a channel without its receiver")
        plain.extend(batches.outputs(t))
    if not events.output_positions:
        return whole + plain
    outs, at = [], 0
    for out, before in zip(whole, events.output_positions):
        outs.extend(plain[at:before])
        at = max(at, before)
        outs.append(out)
    return outs + plain[at:]


def output_to_proto(out: SequenceOutput) -> pb.EngineOutput:
    msg = pb.EngineOutput(
        request_id=out.request_id,
        sample_index=out.sample_index,
        token_ids=out.new_token_ids,
        finish_reason=out.finish_reason or "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        error=out.error or "",
    )
    if out.new_logprobs is not None:
        msg.has_logprobs = True
        msg.logprobs.extend(logprobs_to_proto(e) for e in out.new_logprobs)
    if isinstance(out.stop_reason, str):
        msg.stop_string = out.stop_reason
    elif out.stop_reason is not None:
        msg.stop_token = out.stop_reason
    if out.seed is not None:
        msg.seed = out.seed
    if out.prompt_logprobs is not None:
        msg.has_prompt_logprobs = True
        msg.prompt_logprobs.extend(logprobs_to_proto(e) for e in out.prompt_logprobs[1:])
    if out.held_block_ids is not None:
        msg.held = True
        msg.held_block_ids.extend(out.held_block_ids)
    return msg


def output_from_proto(msg: pb.EngineOutput) -> SequenceOutput:
    stop = msg.WhichOneof("stop")
    return SequenceOutput(
        request_id=msg.request_id,
        sample_index=msg.sample_index,
        new_token_ids=list(msg.token_ids),
        new_logprobs=[logprobs_from_proto(e) or {} for e in msg.logprobs] if msg.has_logprobs else None,
        finish_reason=msg.finish_reason or None,
        stop_reason=getattr(msg, stop) if stop else None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        error=msg.error or None,
        held_block_ids=list(msg.held_block_ids) if msg.held else None,
        seed=msg.seed if msg.HasField("seed") else None,
        prompt_logprobs=(
            [None, *(logprobs_from_proto(e) or {} for e in msg.prompt_logprobs)]
            if msg.has_prompt_logprobs
            else None
        ),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a worker knows of an engine in another process: its limits, KV layout and prefix salt
    (the values ``EngineCore`` offers as attributes, for the registry record and ``GetState``)."""

    limits: RequestLimits
    compat: KVCompat
    prefix_salt: str
    pid: int
    transfer: RemoteKVInfo | None = None  # how peers read its KV (None: no transfer agent)
    loras: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # adapters served: name -> cache salt suffix

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


def ready_to_proto(
    limits: RequestLimits, compat: KVCompat, prefix_salt: str, loras: dict[str, str] | None = None
) -> pb.EngineReady:
    return pb.EngineReady(
        loras=loras or {},
        layout=compat_to_proto(compat),
        num_blocks=limits.num_blocks,
        max_model_len=limits.max_model_len,
        vocab_size=limits.vocab_size,
        max_num_seqs=limits.max_num_seqs,
        cache_salt=prefix_salt,
        pid=os.getpid(),
    )


def facts_from_proto(msg: pb.EngineReady) -> EngineFacts:
    compat = compat_from_proto(msg.layout)
    limits = RequestLimits(
        vocab_size=msg.vocab_size,
        max_num_seqs=msg.max_num_seqs,
        max_model_len=msg.max_model_len,
        block_size=compat.block_size,
        num_blocks=msg.num_blocks,
    )
    transfer = transfer_info_from_proto(msg.transfer) if msg.HasField("transfer") else None
    return EngineFacts(limits, compat, msg.cache_salt, msg.pid, transfer, dict(msg.loras))
