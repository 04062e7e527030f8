"""A minimal P-then-D client over real gRPC: what the router does, without routing."""

from __future__ import annotations

import grpc

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto


class StreamFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


async def prefill(address: str, rid: str, prompt: list[int], params: SamplingParams) -> pb.PrefillResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.PrefillWorkerStub(ch).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params)),
            timeout=60,
        )


async def decode(address: str, rid: str, prompt: list[int], params: SamplingParams, handle=None) -> list[int]:
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(address) as ch:
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params))
        if handle is not None:
            req.handle.CopyFrom(handle)
        async for msg in pb_grpc.DecodeWorkerStub(ch).Decode(req, timeout=60):
            kind = msg.WhichOneof("kind")
            if kind == "tokens":
                tokens.extend(msg.tokens.token_ids)
            elif kind == "error":
                raise StreamFailed(msg.error.code, msg.error.message)
    return tokens


async def generate(
    p_addr: str, d_addr: str, rid: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    resp = await prefill(p_addr, rid, prompt, params)
    first = [resp.handle.first_token]
    if resp.HasField("finished"):
        return first
    return first + await decode(d_addr, rid, prompt, params, resp.handle)


async def state(address: str, role: str) -> pb.WorkerState:
    stub_cls = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
    async with grpc.aio.insecure_channel(address) as ch:
        return await stub_cls(ch).GetState(pb.GetStateRequest(), timeout=10)
