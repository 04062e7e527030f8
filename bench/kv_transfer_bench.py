"""KV transfer: NIXL READ between two processes vs an in-process copy of the same blocks.

One 2k-token request on the engine's 32M bench-model KV layout (8 layers, 4 KV heads, head_dim 64,
float32, block_size 16): 128 blocks of 256 KiB = 32 MiB. An owner process holds a 256-block pool
(the "prefill" side); this process (the "decode" side) READs 128 of its blocks with
``NixlBackend`` in two patterns:

- ``scattered``: every other block on both sides (0, 2, 4, ... -> 1, 3, 5, ...): 128 descriptors,
- ``contiguous``: blocks 0-127 -> 128-255: one merged descriptor,

and, for each, copies the same blocks between two tensors in this process with ``copy_`` per
merged run (the same descriptors) and with ``index_select`` + ``index_copy_`` through a staging
buffer; the copies run before any NIXL agent exists (a UCX progress thread spins a core).
Reported: median GB/s over ``--repeats`` reads after one warm-up (the first read also opens the connection), the
NIXL/copy ratio, the ``start_read`` call time, and the time from ``start_read`` to the owner
seeing the notification (both processes read the same CLOCK_MONOTONIC).

Each KV dtype runs in turn (``--kv-dtypes``; default float32, bfloat16, int8, fp8: the quantized ones
move raw block rows, K/V plus their scales), and a last table gives bytes per token and the read.

    python -m bench.kv_transfer_bench [--repeats 10] [--json out.json] [--kv-dtypes float32 int8]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kv_transfer import KVCompat, RemoteKVInfo, merge_block_runs
from kv_transfer.compat import LAYOUT_BLOCK_MAJOR_V1, LAYOUT_QUANTIZED_TOKEN_SCALES_V1

LAYOUT = dict(model="bench-llama-32m", block_size=16, num_layers=8, num_kv_heads=4, head_dim=64)
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")  # int8 / fp8: quantized blocks with their scales
POOL_BLOCKS = 256
REQUEST_BLOCKS = 128  # 2048 tokens
PATTERNS = {
    "scattered": (list(range(0, 2 * REQUEST_BLOCKS, 2)), list(range(1, 2 * REQUEST_BLOCKS, 2))),
    "contiguous": (list(range(REQUEST_BLOCKS)), list(range(REQUEST_BLOCKS, 2 * REQUEST_BLOCKS))),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compat(kv_dtype: str) -> KVCompat:
    quantized = kv_dtype in ("int8", "fp8")
    layout = LAYOUT_QUANTIZED_TOKEN_SCALES_V1 if quantized else LAYOUT_BLOCK_MAJOR_V1
    return KVCompat(dtype={"fp8": "float8_e4m3fn"}.get(kv_dtype, kv_dtype), layout=layout, **LAYOUT)


def make_pool(seed: int, kv_dtype: str) -> torch.Tensor:
    """The pool's block rows as an engine holds them (a quantized cache: raw rows, data + scales)."""
    from engine.kv_cache import KVLayout
    from engine.kv_quant import storage_dtype

    gen = torch.Generator().manual_seed(seed)
    quant = storage_dtype(kv_dtype) if kv_dtype in ("int8", "fp8") else None
    dtype = torch.float32 if quant else getattr(torch, kv_dtype)
    c = compat(kv_dtype)
    layout = KVLayout(c.num_layers, c.block_size, c.num_kv_heads, c.head_dim, dtype, quant)
    if quant is None:
        return torch.randn((POOL_BLOCKS, *layout.block_shape), generator=gen).to(dtype)
    return torch.randint(0, 256, (POOL_BLOCKS, layout.block_bytes), generator=gen, dtype=torch.uint8)


def owner_main(conn: Connection, env: dict[str, str], progress_thread: bool, kv_dtype: str) -> None:
    """The prefill side: publish the pool, then report when each expected notification arrives."""
    os.environ.update(env)
    from kv_transfer import NixlBackend

    pool = make_pool(0, kv_dtype)
    with NixlBackend("bench-owner", pool, compat(kv_dtype), progress_thread=progress_thread) as backend:
        info = backend.local_info()
        conn.send((info.agent_name, info.agent_metadata, info.base_addr, info.block_bytes, info.num_blocks))
        while (msg := conn.recv()) is not None:
            conn.send("ready")
            seen: list[bytes] = []
            while msg not in seen:
                seen += [m for _, m in backend.get_notifications()]
            conn.send(time.monotonic())


def median_gbps(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / 1e9


def bench_nixl(
    backend, owner: Connection, remote: list[int], local: list[int], repeats: int, tag: str
) -> dict:
    from kv_transfer import TransferState

    read_s, call_s, notify_s = [], [], []
    for rep in range(repeats + 1):  # rep 0 warms up
        msg = f"{tag}-{rep}".encode()
        owner.send(msg)
        assert owner.recv() == "ready"
        t0 = time.monotonic()
        handle = backend.start_read("bench-owner", remote, local, msg, 30.0)
        t1 = time.monotonic()
        while backend.poll(handle) is TransferState.IN_PROGRESS:
            pass
        t2 = time.monotonic()
        if handle.state is not TransferState.DONE:
            raise RuntimeError(f"NIXL read failed: {handle.error}")
        notified = owner.recv()
        if rep == 0:
            first_ms = (t2 - t0) * 1e3
            continue
        call_s.append(t1 - t0)
        read_s.append(t2 - t0)
        notify_s.append(notified - t0)
    num_bytes = len(local) * backend.block_bytes
    return {
        "gbps": median_gbps(num_bytes, read_s),
        "read_ms": [s * 1e3 for s in read_s],
        "first_read_ms": first_ms,
        "start_read_call_ms": statistics.median(call_s) * 1e3,
        "start_to_owner_notified_ms": statistics.median(notify_s) * 1e3,
    }


def bench_copy(remote: list[int], local: list[int], repeats: int, kv_dtype: str) -> dict:
    """The same blocks between two tensors of this process: per merged run, and gather + scatter."""
    src = make_pool(0, kv_dtype)
    dst, staging = torch.zeros_like(src), torch.empty_like(src[: len(local)])
    runs = merge_block_runs(remote, local)
    ridx, lidx = torch.tensor(remote), torch.tensor(local)
    per_run, gathered = [], []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        for r, lo, n in runs:
            dst[lo : lo + n].copy_(src[r : r + n])
        t1 = time.perf_counter()
        dst.index_copy_(0, lidx, torch.index_select(src, 0, ridx, out=staging))
        t2 = time.perf_counter()
        if rep:
            per_run.append(t1 - t0)
            gathered.append(t2 - t1)
    num_bytes = len(local) * src[0].numel() * src.element_size()
    return {
        "copy_runs_gbps": median_gbps(num_bytes, per_run),
        "index_select_copy_gbps": median_gbps(num_bytes, gathered),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed reads per pattern (after a warm-up)")
    parser.add_argument("--ucx-net-devices", default="lo", help="UCX_NET_DEVICES for both agents")
    parser.add_argument(
        "--no-progress-thread",
        action="store_true",
        help="agents without NIXL's UCX progress thread (it spins a core); progress only in poll calls",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES, help="KV cache dtypes to read"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    env = {"UCX_NET_DEVICES": args.ucx_net_devices}
    os.environ.update(env)
    runs = {kv: run_one(kv, args, env) for kv in args.kv_dtypes}
    print(
        f"\none {REQUEST_BLOCKS * LAYOUT['block_size']}-token request's KV by dtype (scattered pattern, NIXL READ):"
    )
    print(f"{'kv dtype':<10}{'bytes/token':>12}{'MiB':>8}{'read ms':>9}{'GB/s':>7}{'bytes vs float32':>18}")
    ref = runs.get("float32")
    for kv, r in runs.items():
        read_ms = statistics.median(r["results"]["scattered"]["read_ms"])
        fewer = f"{ref['bytes_per_token'] / r['bytes_per_token']:.2f}x fewer" if ref else ""
        print(
            f"{kv:<10}{r['bytes_per_token']:>12.0f}{r['request_mib']:>8.2f}{read_ms:>9.2f}"
            f"{r['results']['scattered']['gbps']:>7.2f}{fewer:>18}"
        )
    if args.json is not None:
        payload = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "repeats": args.repeats,
            "progress_thread": not args.no_progress_thread,
            "runs": runs,
        }
        args.json.write_text(json.dumps(payload, indent=2))


def run_one(kv_dtype: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    from kv_transfer import NixlBackend

    log(f"KV dtype {kv_dtype}")
    # the in-process copies run first, before any NIXL agent (and its progress thread) exists
    copies = {}
    for pattern, (remote, local) in PATTERNS.items():
        log(f"{pattern}: in-process copy")
        copies[pattern] = bench_copy(remote, local, args.repeats, kv_dtype)
    progress = not args.no_progress_thread
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    owner = ctx.Process(target=owner_main, args=(child_conn, env, progress, kv_dtype), daemon=True)
    owner.start()
    results = {}
    c = compat(kv_dtype)
    try:
        name, metadata, base, block_bytes, num_blocks = conn.recv()
        info = RemoteKVInfo(name, metadata, base, block_bytes, num_blocks, c)
        reader_kv = torch.zeros_like(make_pool(1, kv_dtype))
        with NixlBackend("bench-reader", reader_kv, c, progress_thread=progress) as backend:
            backend.add_peer(info)
            for pattern, (remote, local) in PATTERNS.items():
                log(
                    f"{pattern}: NIXL, {len(local)} blocks in {len(merge_block_runs(remote, local))} descriptors"
                )
                nixl = bench_nixl(backend, conn, remote, local, args.repeats, pattern)
                if not torch.equal(reader_kv[local], make_pool(0, kv_dtype)[remote]):
                    raise RuntimeError(f"{pattern}: the blocks read differ from the owner's")
                copy = copies[pattern]
                results[pattern] = {
                    **nixl,
                    **copy,
                    "ratio_vs_copy_runs": nixl["gbps"] / copy["copy_runs_gbps"],
                }
        conn.send(None)
    finally:
        owner.join(10)
        if owner.is_alive():
            owner.kill()
    mib = REQUEST_BLOCKS * block_bytes / 2**20
    print(
        f"{kv_dtype}: KV read of {REQUEST_BLOCKS} blocks x {block_bytes / 1024:.1f} KiB = {mib:.2f} MiB, "
        f"median of {args.repeats}"
    )
    for pattern, r in results.items():
        print(
            f"{pattern:>10}: NIXL {r['gbps']:6.2f} GB/s | copy_ per run {r['copy_runs_gbps']:6.2f} GB/s "
            f"(NIXL/copy {r['ratio_vs_copy_runs']:.2f}) | index_select+index_copy_ "
            f"{r['index_select_copy_gbps']:6.2f} GB/s | "
            f"start_read call {r['start_read_call_ms']:.3f} ms | start->owner notified "
            f"{r['start_to_owner_notified_ms']:.2f} ms | first read {r['first_read_ms']:.1f} ms"
        )
    return {
        "layout": {**c.to_dict(), "block_bytes": block_bytes, "request_blocks": REQUEST_BLOCKS},
        "bytes_per_token": block_bytes / c.block_size,
        "request_mib": mib,
        "results": results,
    }


if __name__ == "__main__":
    main()
