"""What the OpenAI HTTP layer is configured with: where it listens and the limits it enforces.

A plain pydantic model, so the ingress runs without Ray Serve; ``deploy.config`` adds the replica
options (count, CPUs) on top of it for the Serve deployment.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IngressOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_concurrent_requests: int = Field(256, ge=1)  # streams forwarded to the router at once
    max_queued_requests: int = Field(512, ge=0)  # waiting for a slot; beyond it: 429
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_n: int = Field(16, ge=1)
    max_logprobs: int = Field(20, ge=0)
    request_timeout_s: float = Field(600.0, gt=0)
    api_key_file: str | None = None  # else PDSERVE_API_KEY; neither: no auth
