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
    # Steps that ran a forward pass, and those replayed from a CUDA graph (pure decode on a GPU).
    num_steps: int = 0
    num_graph_steps: int = 0
    num_held: int = 0
    num_transferring: int = 0
    # The host tier of the prefix cache (0 when off): its size, its use, the prompt tokens served from
    # it (counted in prefix_cache_hits too) and the blocks copied into it.
    host_cache_blocks: int = 0
    host_cache_used: int = 0
    prefix_cache_hits_host: int = 0
    host_offloaded_blocks: int = 0
    # The disk tier under it (0 when off): the same, the blocks written to it, and the blocks read
    # back that failed their content check (recomputed instead).
    disk_cache_blocks: int = 0
    disk_cache_used: int = 0
    prefix_cache_hits_disk: int = 0
    disk_written_blocks: int = 0
    disk_rejected_blocks: int = 0
    # Prefix blocks shared with peer workers through the host tier (engine/kv_lending.py): received
    # (published after their CRC matched), lent, and received ones that failed their CRC.
    peer_received_blocks: int = 0
    peer_lent_blocks: int = 0
    peer_rejected_blocks: int = 0
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


def host_tier_stats(kv) -> dict:
    """The host tier's fields of ``EngineStats`` (none when the KV cache has no host tier)."""
    tier = kv.host_tier
    if tier is None:
        return {}
    return dict(
        host_cache_blocks=tier.num_slots,
        host_cache_used=len(tier),
        prefix_cache_hits_host=kv.prefix_hits_host,
        host_offloaded_blocks=tier.counters.offloaded_blocks,
        peer_received_blocks=tier.counters.received_blocks,
        peer_lent_blocks=tier.counters.lent_blocks,
        peer_rejected_blocks=tier.counters.rejected_blocks,
    )


def disk_tier_stats(kv) -> dict:
    """The disk tier's fields of ``EngineStats`` (none when the KV cache has no disk tier)."""
    tier = kv.disk_tier
    if tier is None:
        return {}
    return dict(
        disk_cache_blocks=tier.num_slots,
        disk_cache_used=len(tier),
        prefix_cache_hits_disk=kv.prefix_hits_disk,
        disk_written_blocks=tier.counters.offloaded_blocks,
        disk_rejected_blocks=tier.counters.rejected_blocks,
    )


def spec_stats(speculator) -> dict:
    """Speculative decoding's fields of ``EngineStats`` (none when the engine does not speculate)."""
    if speculator is None:
        return {}
    st = speculator.stats
    return dict(
        spec_num_drafts=st.num_drafts,
        spec_draft_tokens=st.num_draft_tokens,
        spec_accepted_tokens=st.num_accepted_tokens,
        spec_accepted_per_position=tuple(st.accepted_per_position),
    )
