"""The engine against the device's own limits, measured in the same run.

1. Device limits: copy bandwidth (a large device-to-device copy; bytes read + written per second)
   and the dense matmul rate (8192^3 in the model's dtype).
2. Decode: step time at batch 1, 8, 32, 64, 128, 256 with contexts 128, 1k, 4k on a Llama-shaped
   random-weight model (~0.5B parameters: hidden 1536, 16 layers, 12 heads, 4 KV heads, MLP 4096,
   vocab 32000); achieved bytes/s = (weights + the KV the step reads) / step time, as a percentage of
   the measured copy bandwidth (target >= 70% at batch >= 32).
3. Prefill: tokens/s and achieved FLOP/s (2 x parameters x tokens + attention) as a percentage of the
   measured matmul rate.

    python -m bench.gpu_bench --device cuda --dtype bfloat16 [--json bench/results/gpu_h200.json]
    python -m bench.gpu_bench --quick            # a CPU smoke run with tiny shapes

Pair with ``python -m bench.offline_throughput --model DIR --device cuda --dtype bfloat16`` for the
pdserve vs HF transformers comparison on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

LLAMA_05B = dict(
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=8192,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timeit(fn, device: str, repeats: int) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _timeit(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds  # read + write


def matmul_rate(device: str, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timeit(lambda: a @ b, device, repeats)


def _engine(model_dir: Path, device: str, dtype: str, num_blocks: int, batch_tokens: int, max_seqs: int):
    from engine import EngineConfig, EngineCore

    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            block_size=16,
            num_blocks=num_blocks,
            max_num_batched_tokens=batch_tokens,
            max_num_seqs=max_seqs,
            enable_prefix_caching=False,
        )
    )


def decode_step(core, batch: int, context: int, steps: int) -> float:
    """Seconds per decode step with ``batch`` sequences at ~``context`` tokens."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"d{batch}-{context}-{i}", [(7 * i + j) % 1000 + 10 for j in range(context)], params)
    while any(r.num_computed_tokens < r.prompt_len for r in core.scheduler.requests.values()):
        core.step()  # prefill everything first
    core.step()
    _sync(str(core.device))
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    _sync(str(core.device))
    seconds = (time.perf_counter() - t0) / steps
    for rid in list(core.scheduler.requests):
        core.abort_request(rid)
    core.step()
    return seconds


def prefill_rate(core, prompts: int, length: int) -> float:
    """Prompt tokens per second for ``prompts`` prompts of ``length`` tokens (chunked as configured)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(prompts):
        core.add_request(f"p{length}-{i}", [(3 * i + j) % 1000 + 10 for j in range(length)], params)
    _sync(str(core.device))
    t0 = time.perf_counter()
    while core.has_unfinished():
        core.step()
    _sync(str(core.device))
    return prompts * length / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="tiny model and shapes (a smoke run)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    from engine.tiny_model import create_tiny_model

    quick = a.quick
    shape = TINY if quick else LLAMA_05B
    batches = [1, 8] if quick else [1, 8, 32, 64, 128, 256]
    contexts = [32, 128] if quick else [128, 1024, 4096]
    dtype = getattr(torch, a.dtype)
    out: dict = {"device": a.device, "dtype": a.dtype, "model": shape}
    if a.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    out["copy_bandwidth_Bps"] = bw = copy_bandwidth(
        a.device, (64 if quick else 2048) << 20, 5 if quick else 20
    )
    out["matmul_flops"] = mm = matmul_rate(a.device, dtype, 512 if quick else 8192, 3 if quick else 20)
    print(f"{out.get('gpu', a.device)}: copy {bw / 1e9:.0f} GB/s, {a.dtype} matmul {mm / 1e12:.1f} TFLOP/s")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model(Path(tmp) / "m", "llama", weight_scale=1.0, **shape)
        elem = dtype.itemsize
        max_batch, max_ctx = max(batches), max(contexts)
        num_blocks = max_batch * (max_ctx // 16 + 8) + 16
        core = _engine(model_dir, a.device, a.dtype, num_blocks, max(4096, max_ctx), max_batch)
        params = sum(p.numel() for p in core.model.parameters())
        out["parameters"] = params
        kv_per_token = (
            shape["num_hidden_layers"]
            * 2
            * shape["num_key_value_heads"]
            * (shape["hidden_size"] // shape["num_attention_heads"])
            * elem
        )
        rows = []
        print(f"\n{params / 1e6:.0f}M parameters; decode step (weights + KV read per step):")
        print(f"{'batch':>6}{'context':>9}{'step ms':>10}{'GB/s':>9}{'% copy bw':>11}")
        for ctx in contexts:
            for b in batches:
                if b * (ctx + 64) > num_blocks * 16:
                    continue
                s = decode_step(core, b, ctx, 5 if quick else 30)
                moved = params * elem + b * ctx * kv_per_token
                rows.append(
                    {
                        "batch": b,
                        "context": ctx,
                        "step_s": s,
                        "bytes_per_s": moved / s,
                        "pct_copy_bw": 100 * moved / s / bw,
                    }
                )
                print(f"{b:>6}{ctx:>9}{s * 1e3:>10.2f}{moved / s / 1e9:>9.1f}{100 * moved / s / bw:>10.0f}%")
        out["decode"] = rows
        prefill_rows = []
        print("\nprefill:")
        for length in [128] if quick else [512, 2048]:
            rate = prefill_rate(core, 4 if quick else 16, length)
            att = 2 * 2 * shape["num_hidden_layers"] * shape["hidden_size"] * length / 2  # per token, causal
            flops = rate * (2 * params + att)
            prefill_rows.append(
                {"length": length, "tokens_per_s": rate, "flops": flops, "pct_matmul": 100 * flops / mm}
            )
            print(
                f"  {length}-token prompts: {rate:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s = {100 * flops / mm:.0f}% of matmul"
            )
        out["prefill"] = prefill_rows
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
