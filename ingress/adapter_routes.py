"""vLLM's run-time LoRA endpoints: ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``) and
``POST /v1/unload_lora_adapter`` (``lora_name``).

Off unless the ingress runs with ``allow_runtime_lora`` (a load reads a path of the workers' disks:
an operator's decision, as vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); behind the API key like
every route. A name already loaded is refused (400 ``adapter_already_loaded``) unless the load
says ``load_inplace: true``, which replaces it on every worker or, if one refuses, on none. The
router applies the change on every worker (``router.adapters``) and returns once it is routable;
the ingress then knows the new names at once. Errors are OpenAI-style: 400 with the
workers' reason for an adapter they refuse, 404 for unloading one that is not served, 503 without
workers.
"""

from __future__ import annotations

import grpc
from pydantic import Field, StrictBool, StrictStr

from ingress.openai_protocol import APIError, _Request
from ingress.request_validation import parse_body
from proto import pdserve_pb2 as pb

_NAME = r"^\S(.*\S)?$"  # no surrounding spaces: a request's ``model`` must be able to name it


class LoadLoRAAdapterRequest(_Request):
    lora_name: StrictStr = Field(
        min_length=1, pattern=_NAME, description="the name requests give as their model"
    )
    lora_path: StrictStr = Field(min_length=1, description="the PEFT adapter's directory on the workers")
    load_inplace: StrictBool = Field(
        default=False, description="replace an adapter already loaded under that name (vLLM's)"
    )


class UnloadLoRAAdapterRequest(_Request):
    lora_name: StrictStr = Field(min_length=1)
    lora_int_id: int | None = Field(default=None, description="accepted for vLLM's clients; unused")


async def change_adapter(serving, body: bytes, unload: bool) -> dict:
    if not serving.options.allow_runtime_lora:
        raise APIError(404, "run-time LoRA loading is off (start the ingress with --allow-runtime-lora)")
    if serving.draining:
        raise APIError(503, "server is shutting down", code="draining")
    req = parse_body(body, UnloadLoRAAdapterRequest if unload else LoadLoRAAdapterRequest)
    name = req.lora_name
    if name == serving.info.name:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    change = (
        pb.AdapterRequest(name=name, unload=True)
        if unload
        else pb.AdapterRequest(name=name, path=req.lora_path, replace=req.load_inplace)
    )
    try:
        done = await serving.router.adapter(change)
    except grpc.aio.AioRpcError as exc:
        raise _api_error(exc, unload) from None
    serving.info.adapters.forget_refresh()
    await serving.info.adapters.refresh(serving.router)
    verb = "unloaded" if unload else "loaded"
    return {"object": "lora_adapter", "id": name, "status": verb, "workers": list(done.workers)}


def _api_error(exc: grpc.aio.AioRpcError, unload: bool) -> APIError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.NOT_FOUND or (
        code == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in details
    ):
        return APIError(404, details, param="lora_name", code="model_not_found")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return APIError(400, details, param="lora_name", code="adapter_already_loaded")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # An unload's refusal is about the name (in use); a load's about what its path holds.
        return APIError(400, details, param="lora_name" if unload else "lora_path")
    if code == grpc.StatusCode.UNAVAILABLE:
        return APIError(503, details, code="no_workers")
    return APIError(500, f"the adapter change failed: {details}")
