"""``WorkerState`` / ``KVTransferInfo`` messages <-> the transfer layer's peer description."""

from __future__ import annotations

import os

from engine.stats import EngineStats
from kv_transfer import KVCompat, RemoteKVInfo
from kv_transfer.compat import LAYOUT_BLOCK_MAJOR_V1
from kv_transfer.stats import TRANSFER_SECONDS_BUCKETS, TransferStats
from proto import pdserve_pb2 as pb


def transfer_info_to_proto(info: RemoteKVInfo) -> pb.KVTransferInfo:
    c = info.compat
    return pb.KVTransferInfo(
        agent_name=info.agent_name,
        agent_metadata=info.agent_metadata,
        base_addr=info.base_addr,
        block_bytes=info.block_bytes,
        num_blocks=info.num_blocks,
        compat_hash=c.hash(),
        layout=compat_to_proto(c),
    )


def compat_to_proto(c: KVCompat) -> pb.KVLayoutInfo:
    return pb.KVLayoutInfo(
        num_layers=c.num_layers,
        block_size=c.block_size,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
        model=c.model,
        layout=c.layout,
    )


def compat_from_proto(lay: pb.KVLayoutInfo) -> KVCompat:
    return KVCompat(
        model=lay.model,
        dtype=lay.dtype,
        block_size=lay.block_size,
        layout=lay.layout or LAYOUT_BLOCK_MAJOR_V1,
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
    )


def transfer_info_from_proto(msg: pb.KVTransferInfo) -> RemoteKVInfo:
    compat = compat_from_proto(msg.layout)
    if compat.hash() != msg.compat_hash:
        raise ValueError(f"peer {msg.agent_name} sent a layout that does not match its compatibility hash")
    return RemoteKVInfo(
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        base_addr=msg.base_addr,
        block_bytes=msg.block_bytes,
        num_blocks=msg.num_blocks,
        compat=compat,
    )


def stats_to_proto(s: EngineStats) -> pb.EngineStats:
    return pb.EngineStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_swapped=s.num_swapped,
        num_blocks=s.num_blocks,
        num_free_blocks=s.num_free_blocks,
        kv_usage=s.kv_usage,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions,
        prompt_tokens=s.prompt_tokens,
        generation_tokens=s.generation_tokens,
        num_held_requests=s.num_held,
        num_transferring=s.num_transferring,
        spec_num_drafts=s.spec_num_drafts,
        spec_draft_tokens=s.spec_draft_tokens,
        spec_accepted_tokens=s.spec_accepted_tokens,
        spec_accepted_per_position=s.spec_accepted_per_position,
        prefix_cache_hits_host=s.prefix_cache_hits_host,
        host_cache_blocks=s.host_cache_blocks,
        host_cache_used=s.host_cache_used,
        host_offloaded_blocks=s.host_offloaded_blocks,
        prefix_cache_hits_disk=s.prefix_cache_hits_disk,
        disk_cache_blocks=s.disk_cache_blocks,
        disk_cache_used=s.disk_cache_used,
        disk_written_blocks=s.disk_written_blocks,
        disk_rejected_blocks=s.disk_rejected_blocks,
        peer_received_blocks=s.peer_received_blocks,
        peer_lent_blocks=s.peer_lent_blocks,
        peer_rejected_blocks=s.peer_rejected_blocks,
        num_steps=s.num_steps,
        num_graph_steps=s.num_graph_steps,
    )


def stats_from_proto(s: pb.EngineStats) -> EngineStats:
    return EngineStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_swapped=s.num_swapped,
        num_blocks=s.num_blocks,
        num_free_blocks=s.num_free_blocks,
        kv_usage=s.kv_usage,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions,
        num_swap_outs=0,
        prompt_tokens=s.prompt_tokens,
        generation_tokens=s.generation_tokens,
        num_held=s.num_held_requests,
        num_transferring=s.num_transferring,
        spec_num_drafts=s.spec_num_drafts,
        spec_draft_tokens=s.spec_draft_tokens,
        spec_accepted_tokens=s.spec_accepted_tokens,
        spec_accepted_per_position=tuple(s.spec_accepted_per_position),
        prefix_cache_hits_host=s.prefix_cache_hits_host,
        host_cache_blocks=s.host_cache_blocks,
        host_cache_used=s.host_cache_used,
        host_offloaded_blocks=s.host_offloaded_blocks,
        prefix_cache_hits_disk=s.prefix_cache_hits_disk,
        disk_cache_blocks=s.disk_cache_blocks,
        disk_cache_used=s.disk_cache_used,
        disk_written_blocks=s.disk_written_blocks,
        disk_rejected_blocks=s.disk_rejected_blocks,
        peer_received_blocks=s.peer_received_blocks,
        peer_lent_blocks=s.peer_lent_blocks,
        peer_rejected_blocks=s.peer_rejected_blocks,
        num_steps=s.num_steps,
        num_graph_steps=s.num_graph_steps,
    )


def transfer_stats_from_proto(t: pb.KVTransferStats) -> TransferStats:
    """``transfer_stats_to_proto`` undone (an engine process's pull statistics, in its worker)."""
    return TransferStats(
        bytes=t.bytes,
        completed=t.completed,
        failures=t.failures,
        recomputed=t.recomputed,
        waited=t.waited,
        descriptors=t.descriptors,
        expired_leases=t.expired_leases,
        streamed=t.streamed,
        streamed_bytes=t.streamed_bytes,
        seconds_sum=t.seconds_sum,
        bucket_counts=list(t.bucket_counts),
    )


def transfer_stats_to_proto(t: TransferStats) -> pb.KVTransferStats:

    return pb.KVTransferStats(
        bytes=t.bytes,
        completed=t.completed,
        failures=t.failures,
        recomputed=t.recomputed,
        waited=t.waited,
        descriptors=t.descriptors,
        expired_leases=t.expired_leases,
        streamed=t.streamed,
        streamed_bytes=t.streamed_bytes,
        seconds_sum=t.seconds_sum,
        bucket_bounds=TRANSFER_SECONDS_BUCKETS,
        bucket_counts=t.bucket_counts,
    )


def worker_state_to_proto(
    worker, address: str, stats: EngineStats, transfer: TransferStats | None = None
) -> pb.WorkerState:
    """A worker's GetState answer; ``worker`` is a prefill or decode worker object."""
    limits = worker.limits
    info = worker.transfer_info()
    return pb.WorkerState(
        pid=os.getpid(),
        draining=worker.draining,
        transfer_stats=transfer_stats_to_proto(transfer) if transfer is not None else None,
        worker_id=worker.worker_id,
        epoch=worker.epoch,
        role=worker.role,
        address=address,
        transfer=transfer_info_to_proto(info) if info is not None else None,
        stats=stats_to_proto(stats),
        model=worker.compat.model,
        max_model_len=limits.max_model_len,
        vocab_size=limits.vocab_size,
        cache_salt=worker.prefix_salt,
    )
