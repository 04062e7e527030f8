"""What the OpenAI HTTP layer is configured with: where it listens and the limits it enforces.

A plain pydantic model, so the ingress runs without Ray Serve (``python -m ingress`` derives its
flags from these fields); ``deploy.config`` adds the replica options (count, CPUs) on top of it.
"""

from __future__ import annotations

import argparse
import typing

from pydantic import BaseModel, ConfigDict, Field


class IngressOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP bind address (default: loopback only)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks one)")
    max_concurrent_requests: int = Field(256, ge=1, description="streams forwarded to the router at once")
    max_queued_requests: int | None = Field(
        None,
        ge=0,
        description="requests waiting for a slot; beyond it: 429 (default: 2 x max_concurrent_requests)",
    )
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest request body (413 above)")
    max_n: int = Field(16, ge=1, description="largest n per request")
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        description="longest prompt text in characters (chat: the messages' text), refused before "
        "tokenizing (default: 32 x the model's context length)",
    )
    max_logprobs: int = Field(20, ge=0, description="largest logprobs / top_logprobs per request")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of one request at the router")
    api_key_file: str | None = Field(None, description="file holding the API key (else PDSERVE_API_KEY)")
    allow_runtime_lora: bool = Field(
        False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they load a path of the "
        "workers' disks; off: 404)",
    )


def add_ingress_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per ``IngressOptions`` field (``max_n`` -> ``--max-n``), its default and help from the
    field; ``only`` limits it to those fields (a command that declares the others itself)."""
    for name, f in IngressOptions.model_fields.items():
        if only is not None and name not in only:
            continue
        args = typing.get_args(f.annotation)
        typ = next((a for a in args if a is not type(None)), f.annotation) if args else f.annotation
        if typ is bool:
            flag = "--" + name.replace("_", "-")
            parser.add_argument(
                flag, dest=name, default=f.default, action=argparse.BooleanOptionalAction, help=f.description
            )
            continue
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, type=typ, default=f.default, help=f.description
        )
