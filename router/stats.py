"""What a router counts about the requests it routed (served as ``ClusterStatus``: router/service.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(slots=True)
class RouterStats:
    # This router replica's id (one per process life): the label that keeps replicas' counters
    # apart when several answer one scrape target (front ends sharing a port, each with its router).
    router_id: str = field(default_factory=lambda: f"router-{uuid.uuid4().hex[:8]}")
    requests: int = 0
    prefill_retries: int = 0
    decode_retries: int = 0
    local_prefills: int = 0  # short uncached prompts prefilled on their decode worker
    kv_streamed: int = 0  # requests whose early Decode (KV streaming) took the complete handle
    aggregated_fallbacks: int = 0
    failed: int = 0
    failed_by_code: dict[str, int] = field(default_factory=dict)  # the gRPC status each ended with
    predicted_hit_tokens: int = 0
    delivered_hit_tokens: int = 0
    prompt_tokens: int = 0
    migrations: int = 0  # streams resumed on another decode worker
    stalls: int = 0  # decode streams given up on as stalled
    migrations_refused: int = 0  # lost streams that could not be resumed (limit, no worker, n > 1)
    peer_reads: int = 0  # prefills sent with a peer to read the prompt's prefix from

    def fail(self, code) -> None:
        """A request the router could not serve, ending with gRPC status ``code``."""
        self.failed += 1
        self.failed_by_code[code.name] = self.failed_by_code.get(code.name, 0) + 1
