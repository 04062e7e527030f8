"""What an engine reports about itself: queues, KV usage, prefix-cache and speculation counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_swap_outs: int
    prompt_tokens: int
    generation_tokens: int
    num_held: int = 0
    num_transferring: int = 0
    # The host tier of the prefix cache (0 when off): its size, its use, the prompt tokens served from
    # it (counted in prefix_cache_hits too) and the blocks copied into it.
    host_cache_blocks: int = 0
    host_cache_used: int = 0
    prefix_cache_hits_host: int = 0
    host_offloaded_blocks: int = 0
    # Speculative decoding (0 / empty when off): a draft is one sequence's proposal in one step.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculating step emits per sequence on average: accepted drafts plus one."""
        return 1 + self.spec_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
