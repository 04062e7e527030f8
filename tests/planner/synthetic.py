"""A profile with known costs for the planner's tests: its samples come exactly from these curves."""

from __future__ import annotations

from planner.costs import ModelProfile

BS = 16
PREFILL = (0.010, 1e-4, 1e-8)  # base, per new token, per new token x context
DECODE = (0.005, 1e-3, 1e-7)  # base, per sequence, per sequence x context
TRANSFER = (0.002, 1e-9)  # base, per byte
KV_BYTES_PER_TOKEN = 1024


def synthetic_profile(num_blocks: int = 1000, budget: int = 4096) -> ModelProfile:
    """A profile whose samples come exactly from known curves (the fit recovers them)."""

    def line(coef, feats):
        return sum(c * f for c, f in zip(coef, feats, strict=True))

    prefill = [
        {"new": n, "cached": c, "seconds": line(PREFILL, [1, n, n * (c + n / 2)])}
        for n in (16, 256, 1024)
        for c in (0, 512)
    ]
    decode = [
        {"batch": b, "context": c, "seconds": line(DECODE, [1, b, b * c])}
        for b in (1, 8, 64)
        for c in (128, 2048)
    ]
    transfer = [{"bytes": n, "seconds": line(TRANSFER, [1, n])} for n in (1 << 14, 1 << 20, 1 << 24)]
    return ModelProfile(
        model={"name": "synthetic", "block_size": BS, "kv_bytes_per_token": KV_BYTES_PER_TOKEN},
        hardware={"device": "none"},
        engine={"max_num_batched_tokens": budget, "max_num_seqs": 256, "num_blocks": num_blocks},
        prefill_samples=prefill,
        decode_samples=decode,
        transfer_samples=transfer,
        transfer_backend="nixl",
    )
