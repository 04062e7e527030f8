"""What a disk-tier write costs the engine's thread: queued for the writer thread vs written in place.

The host tier overflows inside an admission, on the engine's thread; each block it pushes down is
written to the disk tier's file (engine/kv_disk_tier.py). This times, per block, what the engine's
thread spends in ``DiskBlocks.write`` (a copy and a queue put) against the synchronous write it
replaced (CRC32 + ``pwritev`` on the same thread, ``_FileIO._write``), in the same run, for block
sizes of a small and an 8B-class model, and how long the queued writes take to land (``flush``).
Writes come back to back (the worst case: the writer thread competes for the cores and the memory
bus with every copy), and one per 2 ms of the engine's thread waiting (as it waits on a GPU's step).

    .venv/bin/python -m bench.kv_disk_writes        # ~30 s here
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.kv_disk_tier import DiskBlocks

RESULTS = Path(__file__).parent / "results"
# bytes per block: the bench's tiny Llama (256 KiB) and a Llama-3-8B block of 16 tokens in bf16
# (16 tokens x 32 layers x K and V x 8 KV heads x 128 x 2 bytes = 2 MiB)
SIZES = {"256 KiB": 256 << 10, "2 MiB": 2 << 20}


def time_writes(block_bytes: int, blocks: int, queued: bool, directory: str, gap_s: float) -> dict:
    rows = torch.randint(0, 255, (blocks, block_bytes), dtype=torch.uint8)
    disk = DiskBlocks(torch.zeros(4, block_bytes, dtype=torch.uint8), blocks, directory)
    try:
        per_block = []
        t0 = time.perf_counter()
        for slot in range(blocks):
            key = slot.to_bytes(16, "little")
            t = time.perf_counter()
            if queued:
                disk.write(slot, key, rows[slot])
            else:
                disk._io._write(slot, key, rows[slot])  # the synchronous write it replaced
            per_block.append(time.perf_counter() - t)
            if gap_s:
                time.sleep(gap_s)
        disk.flush()
        landed = time.perf_counter() - t0
        assert all(disk.read(s, s.to_bytes(16, "little"), 0) for s in (0, blocks - 1))
    finally:
        disk.close()
    return {
        "engine_thread_us_per_block_p50": statistics.median(per_block) * 1e6,
        "engine_thread_us_per_block_mean": statistics.fmean(per_block) * 1e6,
        "all_landed_s": landed,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=96, help="blocks written per run")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each way (medians)")
    p.add_argument("--dir", help="the file's directory (default: a temporary one)")
    p.add_argument("--output", type=Path, default=RESULTS / "kv_disk_writes_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {"blocks": args.blocks, "repeats": args.repeats, "sizes": {}}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for (name, size), gap_ms in itertools.product(SIZES.items(), (0, 2)):
            runs: dict[str, list[dict]] = {"synchronous": [], "queued": []}
            for _ in range(args.repeats):
                for way in runs:
                    runs[way].append(time_writes(size, args.blocks, way == "queued", directory, gap_ms / 1e3))
            row = {way: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for way, rs in runs.items()}
            sync, queued = row["synchronous"], row["queued"]
            row["engine_thread_ratio"] = (
                queued["engine_thread_us_per_block_mean"] / sync["engine_thread_us_per_block_mean"]
            )
            out["sizes"][f"{name}, {gap_ms} ms apart"] = row
            print(
                f"{name:>8}, {gap_ms} ms apart: engine thread per block {sync['engine_thread_us_per_block_mean']:8.1f} us "
                f"synchronous, {queued['engine_thread_us_per_block_mean']:8.1f} us queued "
                f"({row['engine_thread_ratio']:.2f}x); {args.blocks} blocks landed in "
                f"{sync['all_landed_s'] * 1e3:.1f} / {queued['all_landed_s'] * 1e3:.1f} ms"
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
