"""The engine's disaggregation calls: a mixin of ``engine.engine_core.EngineCore``.

Prefill role: a request's prompt KV is *held* after its first token until the peer's read is done
(``release_held``); while the prompt is still being computed, its finished blocks can be *exposed*
(``expose_computed``: pinned, so no preemption, abort or eviction frees them) for a peer to read
early, until ``unpin``. Decode role: a pulled prompt gets its blocks at once and is parked until the
pull completes (``add_transferred_request`` -> ``complete_transfer`` | ``fail_transfer``); when its
blocks are pulled while the peer still computes, the first token comes later (``set_first_token``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Where a pulled prompt's KV goes: ``local_block_ids[i]`` receives the peer's block
    ``first_block_index + i`` of the request; earlier blocks were local prefix-cache hits."""

    local_block_ids: list[int]
    first_block_index: int
    num_cached_tokens: int


class TransferMixin:
    kv: KVCacheManager
    scheduler: Scheduler
    eos_token_ids: frozenset[int]
    max_model_len: int
    device: torch.device

    # Prefill role -------------------------------------------------------------------------------

    def release_held(self, request_id: str) -> bool:
        """Prefill role: free a held request's blocks (after the peer's read, or at lease expiry)."""
        return self.kv.release_held(request_id)

    def expose_computed(self, request_id: str, num_exposed: int) -> list[int]:
        """Prefill role: the ids of the request's prompt blocks computed since the first
        ``num_exposed`` (full blocks whose KV is final), pinned until ``unpin``; [] when none are new
        or the request is not running (queued, preempted, finished)."""
        req = self.scheduler.requests.get(request_id)
        table = self.kv.block_ids(req) if req is not None else []
        if not table:
            return []
        done = min(req.num_computed_tokens, req.prompt_len) // self.kv.block_size
        new = table[num_exposed:done]
        if new:
            if self.device.type == "cuda":  # the step's kernels must have written them
                torch.cuda.current_stream(self.device).synchronize()
            self.kv.pin(request_id, new)
        return new

    def unpin(self, request_id: str) -> None:
        """Prefill role: drop the pins ``expose_computed`` took (no-op when there are none)."""
        self.kv.unpin(request_id)

    # Decode role --------------------------------------------------------------------------------

    def add_transferred_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int | None,
        params: SamplingParams,
        *,
        seed: int,
        first_logprobs: dict[int, float] | None = None,
        priority: int = 0,
    ) -> TransferPlan | None:
        """Decode role: a request whose prompt KV a peer computes and whose first token it samples.

        Allocates blocks for the prompt (reusing local prefix hits) and parks the request until
        ``complete_transfer`` (it then decodes from token 2 on) or ``fail_transfer`` (it recomputes
        locally). ``first_token`` None: the peer is still computing; ``set_first_token`` gives it
        (and the seed) before ``complete_transfer``. Returns None when the first token already ends
        the request. Raises ValueError for a request this engine can never serve, ``NoKVRoomError``
        when the pool has no room right now.
        """
        self._check_new_id(request_id)
        self.validate(prompt_token_ids, params)
        if params.n != 1:
            raise ValueError("disaggregated decode serves n = 1 only; run n > 1 requests aggregated")
        if params.prompt_logprobs is not None:  # the peer that computed the prompt sent them
            params = dataclasses.replace(params, prompt_logprobs=None)
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            **self.lora_args(params.lora),
        )
        if first_token is not None and not self._append_first(req, first_token, first_logprobs):
            return None
        fresh, first_index = self.scheduler.add_transferring(req, len(prompt_token_ids))
        return TransferPlan(fresh, first_index, max(req.num_cached_tokens, 0))

    def set_first_token(
        self, request_id: str, first_token: int, first_logprobs: dict[int, float] | None, seed: int
    ) -> bool:
        """Decode role: the first token (and seed) of a request parked without them; False when it
        ends the request (then drop it with ``fail_request`` or ``abort_request``). Raises
        ValueError for a token outside the vocabulary."""
        req = self.scheduler.transferring[request_id]
        req.seed = seed
        return self._append_first(req, first_token, first_logprobs)

    def _append_first(self, req: Request, token: int, logprobs: dict[int, float] | None) -> bool:
        if not 0 <= token < self.spec.vocab_size:
            raise ValueError(f"first token {token} is outside the vocabulary [0, {self.spec.vocab_size})")
        req.append_token(token, logprobs)
        return req.check_stop(self.max_model_len) is None

    def complete_transfer(self, request_id: str) -> None:
        req = self.scheduler.transferring[request_id]
        self.scheduler.complete_transfer(request_id, req.prompt_len)

    def quarantine_blocks(self, request_id: str) -> str:
        """Detach a transferring request's blocks and keep them allocated (a timed-out read that NIXL
        cannot abort may still write them); returns the key for ``release_held`` once it settled."""
        key = f"{request_id}#quarantine"
        self.kv.hold(self.scheduler.transferring[request_id], key)
        return key

    def fail_transfer(self, request_id: str) -> None:
        """The pull failed or timed out (and has settled): recompute the prompt locally."""
        self.scheduler.fail_transfer(request_id)
