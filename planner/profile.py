"""``pdserve profile``'s measurements, on the real engine (issue 34): what the planner's cost curves
(``planner.costs``) are fitted to.

- **Prefill**: one request at a time, ``new`` uncached prompt tokens after ``cached`` ones the prefix
  cache holds (a request of the prefix alone ran just before, so its whole blocks are cached): the
  wall time from admission to its first token, chunked as the engine's token budget chunks it.
- **Decode**: ``batch`` sequences of ``context`` prompt tokens prefilled, then the wall time per
  step over ``steps`` decode steps (pairs that do not fit the KV pool are skipped).
- **KV transfer**: a second process (``python -m planner.kv_owner``) holds blocks of this engine's KV
  layout behind a NIXL agent; this process READs 1, 4, 16, ... of them, as a decode worker pulls a
  prompt's blocks. Skipped (and said so) where NIXL is not installed.

Every sample is the median of ``repeats`` runs after one warm-up; prompts are distinct random tokens,
so nothing is cached that the sample did not ask for.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import EngineCore, SamplingParams
from planner.costs import ModelProfile

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Grid:
    prefill_lengths: tuple[int, ...]
    cached_shares: tuple[float, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    transfer_blocks: tuple[int, ...]
    repeats: int = 3
    decode_steps: int = 8

    @classmethod
    def default(cls, quick: bool = False) -> Grid:
        if quick:  # a smoke run: seconds on a CPU with a tiny model
            return cls((16, 64, 128), (0.0, 0.5), (1, 4, 8), (32, 128), (1, 4, 16), repeats=2, decode_steps=4)
        return cls(
            (64, 256, 1024, 2048, 4096),
            (0.0, 0.5, 0.9),
            (1, 8, 32, 64, 128, 256),
            (256, 1024, 4096),
            (1, 4, 16, 64, 256),
        )


def model_identity(core: EngineCore, name: str) -> dict:
    spec, layout = core.spec, core.layout
    return {
        "name": name,
        "architecture": spec.architecture,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "kv_cache_dtype": core.config.kv_cache_dtype,
        "block_size": layout.block_size,
        "kv_bytes_per_token": layout.block_bytes // layout.block_size,
        "max_model_len": core.max_model_len,
    }


def hardware() -> dict:
    import os

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
    }


class _Prompts:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.n = 0

    def make(self, length: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(length)]

    def rid(self) -> str:
        self.n += 1
        return f"profile-{self.n}"


def _sync(core: EngineCore) -> None:
    if core.device.type == "cuda":
        torch.cuda.synchronize()


def _run_until_first_token(core: EngineCore, rid: str) -> None:
    while True:
        for out in core.step():
            if out.request_id == rid and out.new_token_ids:
                _sync(core)
                return


def measure_prefill(core: EngineCore, grid: Grid, prompts: _Prompts, progress: Progress) -> list[dict]:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    bs = core.layout.block_size
    samples = []
    for length in grid.prefill_lengths:
        for share in grid.cached_shares:
            cached = int(length * share) // bs * bs
            new = length - cached
            if length + 1 > core.max_model_len or new < 1 or (share > 0 and cached == 0):
                continue  # too long, or a share smaller than one block (the sample without it covers it)
            times = []
            for rep in range(grid.repeats + 1):  # rep 0 warms up
                prefix = prompts.make(cached)
                if cached:  # the prefix alone first: its whole blocks stay in the prefix cache
                    rid = prompts.rid()
                    core.add_request(rid, prefix, one)
                    _run_until_first_token(core, rid)
                    while core.has_unfinished():
                        core.step()
                rid = prompts.rid()
                t0 = time.perf_counter()
                core.add_request(rid, prefix + prompts.make(new), one)
                _run_until_first_token(core, rid)
                if rep:
                    times.append(time.perf_counter() - t0)
                while core.has_unfinished():
                    core.step()
            samples.append({"new": new, "cached": cached, "seconds": statistics.median(times)})
            progress(f"prefill {new} new + {cached} cached tokens: {samples[-1]['seconds'] * 1e3:.2f} ms")
    return samples


def measure_decode(core: EngineCore, grid: Grid, prompts: _Prompts, progress: Progress) -> list[dict]:
    bs = core.layout.block_size
    samples = []
    for context in grid.decode_contexts:
        for batch in grid.decode_batches:
            steps = grid.decode_steps
            blocks = batch * -(-(context + steps * (grid.repeats + 2)) // bs)
            if (
                context + steps * (grid.repeats + 2) > core.max_model_len
                or blocks > core.kv.num_blocks
                or batch > core.config.max_num_seqs
            ):
                continue
            params = SamplingParams(temperature=0, max_tokens=steps * (grid.repeats + 2), ignore_eos=True)
            rids = [prompts.rid() for _ in range(batch)]
            for rid in rids:
                core.add_request(rid, prompts.make(context), params)
            while any(r.num_computed_tokens < r.prompt_len for r in core.scheduler.requests.values()):
                core.step()
            core.step()
            times = []
            for rep in range(grid.repeats + 1):
                _sync(core)
                t0 = time.perf_counter()
                for _ in range(steps):
                    core.step()
                _sync(core)
                if rep:
                    times.append((time.perf_counter() - t0) / steps)
            mean_ctx = context + steps * (grid.repeats + 1) / 2
            for rid in rids:
                core.abort_request(rid)
            while core.has_unfinished():
                core.step()
            samples.append({"batch": batch, "context": mean_ctx, "seconds": statistics.median(times)})
            progress(f"decode batch {batch} at context {context}: {samples[-1]['seconds'] * 1e3:.2f} ms/step")
    return samples


def measure_transfer(core: EngineCore, grid: Grid, progress: Progress) -> list[dict]:
    """READs of 1, 4, 16, ... blocks from a NIXL agent in another process; [] without NIXL."""
    try:
        from kv_transfer.nixl_backend import NixlBackend
    except Exception as exc:  # NIXL is not installed here
        progress(f"KV transfer not measured: NIXL is not available ({exc})")
        return []
    from kv_transfer import KVCompat, TransferState
    from kv_transfer.base import RemoteKVInfo

    kv = core.runner.kv_blocks
    if not isinstance(kv, torch.Tensor):
        progress("KV transfer not measured: a quantized KV cache (measure with the full-precision cache)")
        return []
    count = max(grid.transfer_blocks)
    shape, dtype = (count, *kv.shape[1:]), str(kv.dtype).removeprefix("torch.")
    compat = KVCompat.from_layout("profile", core.layout)
    spec = {"shape": list(shape), "dtype": dtype, "device": str(kv.device), "compat": compat.to_dict()}
    owner = subprocess.Popen(
        [sys.executable, "-m", "planner.kv_owner", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    samples = []
    try:
        offer = json.loads(owner.stdout.readline() or "{}")
        if "agent" not in offer:
            raise RuntimeError(f"the KV owner process failed (exit {owner.wait()})")
        local = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
        with NixlBackend("profile-reader", local, compat, progress_thread=True) as backend:
            backend.add_peer(
                RemoteKVInfo(
                    offer["agent"],
                    bytes.fromhex(offer["metadata"]),
                    offer["base_addr"],
                    offer["block_bytes"],
                    offer["num_blocks"],
                    compat,
                    offer["mem_type"],
                    offer["device_id"],
                )
            )
            for n in grid.transfer_blocks:
                times = []
                for rep in range(grid.repeats + 1):
                    blocks = list(range(n))
                    t0 = time.perf_counter()
                    handle = backend.start_read(offer["agent"], blocks, blocks, f"p{n}-{rep}".encode(), 60.0)
                    while backend.poll(handle) is TransferState.IN_PROGRESS:
                        pass
                    if handle.state is not TransferState.DONE:
                        raise RuntimeError(f"a NIXL read failed: {handle.error}")
                    backend.release(handle)
                    if rep:
                        times.append(time.perf_counter() - t0)
                samples.append({"bytes": n * backend.block_bytes, "seconds": statistics.median(times)})
                progress(
                    f"KV transfer of {n} blocks ({samples[-1]['bytes'] / 2**20:.2f} MiB): "
                    f"{samples[-1]['seconds'] * 1e3:.3f} ms"
                )
    finally:
        owner.stdin.close()
        owner.wait(30)
    return samples


def profile_engine(
    core: EngineCore, name: str, grid: Grid, transfer: bool = True, progress: Progress = print
) -> ModelProfile:
    prompts = _Prompts(core.spec.vocab_size)
    prefill = measure_prefill(core, grid, prompts, progress)
    decode = measure_decode(core, grid, prompts, progress)
    moved = measure_transfer(core, grid, progress) if transfer else []
    return ModelProfile(
        model=model_identity(core, name),
        hardware=hardware(),
        engine={
            "max_num_batched_tokens": core.config.max_num_batched_tokens,
            "max_num_seqs": core.config.max_num_seqs,
            "num_blocks": core.kv.num_blocks,
            "enable_prefix_caching": core.config.enable_prefix_caching,
        },
        prefill_samples=prefill,
        decode_samples=decode,
        transfer_samples=moved,
        transfer_backend="nixl" if moved else "",
    )
