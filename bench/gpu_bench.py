"""The engine against the device's own limits, measured in the same run.

1. Device limits: copy bandwidth (a large device-to-device copy; bytes read + written per second)
   and the dense matmul rate (8192^3 in the model's dtype).
2. Decode: engine step time at batch 1, 8, 32, 64, 128, 256 with contexts 128, 1k, 4k on a
   Llama-shaped random-weight model (~0.5B parameters: hidden 1536, 16 layers, 12 heads, 4 KV heads,
   MLP 4096, vocab 32000); achieved bytes/s = (weights read + the KV the step reads) / step time, as a
   percentage of the measured copy bandwidth (target >= 70% at batch >= 32). The input embedding is a
   gather of one row per sequence, so it is not counted as weights read (the LM head is).
3. Prefill: tokens/s and achieved FLOP/s (2 x the decoder layers' parameters x tokens + causal
   attention; the LM head runs only at each prompt's last token) as a percentage of the measured
   matmul rate.

``--kv-cache-dtype int8|fp8`` measures a quantized KV cache (its decode steps run eagerly, without CUDA
graphs, as ``--no-cuda-graphs`` runs them for any cache). ``--profile B,CTX`` adds a breakdown of
decode steps at batch B, context CTX: the GPU kernels by time and how much of the step the GPU is
busy at all (torch.profiler), then the host functions by their own time (cProfile).

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


def _engine(
    model_dir: Path,
    device: str,
    dtype: str,
    kv_cache_dtype: str,
    cuda_graphs: bool,
    num_blocks: int,
    batch_tokens: int,
    max_seqs: int,
    async_scheduling: str = "off",
):
    from engine import EngineConfig, EngineCore

    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            cuda_graphs=cuda_graphs,
            block_size=16,
            num_blocks=num_blocks,
            max_num_batched_tokens=batch_tokens,
            max_num_seqs=max_seqs,
            enable_prefix_caching=False,
            # Prompts take the whole token budget while any wait, so sequences prefilled early do not
            # decode (and finish) while the rest of the batch prefills: every one decodes when timed.
            scheduling_policy="prefill_first",
            async_scheduling=async_scheduling,
        )
    )


def _start_decodes(core, batch: int, context: int, steps: int) -> float:
    """``batch`` sequences of ``context`` prompt tokens, prefilled, and one decode step run; returns
    their mean context over the next ``steps`` decode steps."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"d{batch}-{context}-{i}", [(7 * i + j) % 1000 + 10 for j in range(context)], params)
    while any(r.num_computed_tokens < r.prompt_len for r in core.scheduler.requests.values()):
        core.step()  # prefill everything first
    core.step()
    _sync(str(core.device))
    reqs = core.scheduler.requests.values()
    return sum(r.num_tokens for r in reqs) / max(len(reqs), 1) + (steps - 1) / 2


def _abort_all(core) -> None:
    for rid in list(core.scheduler.requests):
        core.abort_request(rid)
    core.step()


def decode_step(core, batch: int, context: int, steps: int) -> tuple[float, float, float]:
    """Seconds per decode step with ``batch`` sequences at ~``context`` tokens; the tokens each step
    produced (``batch`` unless the scheduler ran fewer sequences) and the mean context attended."""
    mean_ctx = _start_decodes(core, batch, context, steps)
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in core.step())
    _sync(str(core.device))
    seconds = (time.perf_counter() - t0) / steps
    _abort_all(core)
    return seconds, tokens / steps, mean_ctx


def mixed_step(
    core, batch: int, context: int, steps: int, prompt_len: int = 16, cached: int = 0
) -> tuple[float, float, float]:
    """(wall, host CPU) seconds per step of ``batch - 1`` decoding sequences plus one new
    ``prompt_len``-token prompt each step (a request that ends at its first token), the step a served
    engine runs when requests arrive one at a time (replayed from a decode graph with
    ``cuda_graph_mixed``, else launched eagerly).
    ``prompt_len`` 0: ``batch`` decodes alone, timed the same way. ``cached``: each prompt follows
    the same ``cached`` tokens, found in the prefix cache (a conversation's next turn; the engine's
    prefix caching on, ``prefix_caching``). Also the share of the steps replayed from a graph (a
    step of more tokens than the largest graph runs eagerly either way)."""
    from engine import SamplingParams

    _start_decodes(core, batch - 1 if prompt_len else batch, context, steps)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefix = [(13 * j) % 1000 + 10 for j in range(cached)]
    if cached:  # computed once, untimed: every prompt after it finds it cached
        rid = f"p{batch}-{context}"
        core.add_request(rid, [*prefix, 5], one)
        while rid in core.scheduler.requests:
            core.step()
    before = core.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        if prompt_len:
            prompt = prefix + [(11 * i + j) % 1000 + 10 for j in range(prompt_len)]
            core.add_request(f"m{batch}-{context}-{i}", prompt, one)
        core.step()
    _sync(str(core.device))
    wall, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
    after = core.stats()
    ran = after.num_steps - before.num_steps
    graphs = (after.num_graph_steps - before.num_graph_steps) / ran if ran else 0.0
    _abort_all(core)
    return wall, cpu, graphs


def prefix_caching(core, on: bool) -> None:
    """Turn the idle engine's prefix caching on or off (this benchmark's engines run without it, so
    that no measured prompt finds another's blocks)."""
    kv = core.kv
    if not on and not kv.pool.reset_prefix_cache():
        raise RuntimeError("prefix caching can only be turned off with every block free")
    kv.enable_caching = kv.pool.enable_caching = on


def mixed_table(core, batches: list[int], context: int, n: int, turn: int, cached: int) -> list[dict]:
    """``mixed_step`` rows, printed as they come: decode steps, then mixed steps replayed from the
    graphs (``cuda_graph_mixed``) and launched eagerly, in the same run."""
    graph_runner, rows = core.runner.decode_graphs, []
    print(f"{'batch':>6}{'decode ms':>11}{'cpu ms':>8}{'mixed ms':>10}{'cpu ms':>8}{'graph':>7}"
          f"{'eager ms':>10}{'cpu ms':>8}{'mixed/decode':>14}{'eager/mixed':>13}")  # fmt: skip
    for b in batches:
        d_wall, d_cpu, _ = mixed_step(core, b, context, n, prompt_len=0)
        m_wall, m_cpu, m_graphs = mixed_step(core, b, context, n, turn, cached)
        e_wall, e_cpu = m_wall, m_cpu
        if graph_runner is not None and graph_runner.mixed:
            graph_runner.mixed = False
            e_wall, e_cpu, _ = mixed_step(core, b, context, n, turn, cached)
            graph_runner.mixed = True
        rows.append({"batch": b, "context": context, "prompt_tokens": turn, "cached_prefix": cached,
                     "decode_s": d_wall, "mixed_s": m_wall, "mixed_cpu_s": m_cpu, "decode_cpu_s": d_cpu,
                     "mixed_graph_share": m_graphs, "eager_mixed_s": e_wall, "eager_mixed_cpu_s": e_cpu})  # fmt: skip
        print(f"{b:>6}{d_wall * 1e3:>11.2f}{d_cpu * 1e3:>8.2f}{m_wall * 1e3:>10.2f}{m_cpu * 1e3:>8.2f}"
              f"{100 * m_graphs:>6.0f}%{e_wall * 1e3:>10.2f}{e_cpu * 1e3:>8.2f}{m_wall / d_wall:>13.2f}x"
              f"{e_wall / m_wall:>12.2f}x")  # fmt: skip
    return rows


def profile_decode(core, batch: int, context: int, steps: int, top: int = 12) -> dict:
    """torch.profiler over ``steps`` decode steps: GPU kernel time by kernel, and the share of the
    step's wall time the GPU spends in any kernel (the rest is host work the GPU waits on); then
    cProfile over as many more: the host functions that take the step's time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    _start_decodes(core, batch, context, 2 * steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        _sync(str(core.device))
        wall = (time.perf_counter() - t0) / steps
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        core.step()
    _sync(str(core.device))
    host.disable()
    _abort_all(core)
    stats = pstats.Stats(host).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
    own = sorted(
        ((f"{n} ({Path(f).name}:{line})", v[2]) for (f, line, n), v in stats.items()), key=lambda x: -x[1]
    )
    kernels = [
        (e.key, getattr(e, "self_device_time_total", 0) / 1e6 / steps, e.count / steps)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    kernels.sort(key=lambda k: -k[1])
    busy = sum(k[1] for k in kernels)
    return {
        "batch": batch,
        "context": context,
        "step_s": wall,
        "gpu_kernel_s_per_step": busy,
        "gpu_busy_pct": 100 * busy / wall,
        "host_self_s_per_step": [{"function": n, "s_per_step": t / steps} for n, t in own[:top]],
        "top_kernels": [
            {"kernel": n[:120], "s_per_step": t, "launches_per_step": c} for n, t, c in kernels[:top]
        ],
    }


def prefill_rate(core, prompts: int, length: int) -> float:
    """Prompt tokens per second for ``prompts`` prompts of ``length`` tokens (chunked as configured),
    after one untimed round of the same shapes."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for rnd in ("warm", "timed"):
        for i in range(prompts):
            core.add_request(f"p{length}-{rnd}-{i}", [(3 * i + j) % 1000 + 10 for j in range(length)], params)
        _sync(str(core.device))
        t0 = time.perf_counter()
        while core.has_unfinished():
            core.step()
        _sync(str(core.device))
    return prompts * length / (time.perf_counter() - t0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    p.add_argument(
        "--async-scheduling",
        default="off",
        choices=["off", "on"],
        help="overlapped steps (the engine option)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model and shapes (a smoke run)")
    p.add_argument("--batches", type=_ints, default=None, help="decode batch sizes, e.g. 1,32,256")
    p.add_argument("--contexts", type=_ints, default=None, help="decode contexts, e.g. 128,4096")
    p.add_argument("--profile", type=_ints, default=None, metavar="B,CTX", help="profile decode at B, CTX")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    from engine.tiny_model import create_tiny_model

    quick = a.quick
    shape = TINY if quick else LLAMA_05B
    batches = a.batches or ([1, 8] if quick else [1, 8, 32, 64, 128, 256])
    contexts = a.contexts or ([32, 128] if quick else [128, 1024, 4096])
    dtype = getattr(torch, a.dtype)
    out: dict = {"device": a.device, "dtype": a.dtype, "kv_cache_dtype": a.kv_cache_dtype, "model": shape}
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
        if a.profile:
            max_batch, max_ctx = max(max_batch, a.profile[0]), max(max_ctx, a.profile[1])
        num_blocks = max_batch * (max_ctx // 16 + 8) + 16
        t0 = time.perf_counter()
        batch_tokens = max(4096, max_ctx)
        graphs = not a.no_cuda_graphs
        core = _engine(
            model_dir, a.device, a.dtype, a.kv_cache_dtype, graphs, num_blocks, batch_tokens, max_batch,
            a.async_scheduling,
        )  # fmt: skip
        out["engine_start_s"] = time.perf_counter() - t0
        out["cuda_graphs"] = core.runner.decode_graphs is not None
        out["async_scheduling"] = getattr(core, "overlap", False)
        out["torch_threads"] = torch.get_num_threads()
        params = sum(p.numel() for p in core.model.parameters())
        embed, head = core.model.model.embed_tokens.weight, core.model.lm_head.weight
        decode_params = params - (0 if head is embed else embed.numel())  # every weight but the gather
        layer_params = params - embed.numel() - (0 if head is embed else head.numel())
        out["parameters"] = params
        kv_per_token = core.layout.block_bytes / core.layout.block_size  # quantized: with its scales
        rows = []
        print(
            f"\n{params / 1e6:.0f}M parameters, KV cache {a.kv_cache_dtype}, decode CUDA graphs "
            f"{'on' if out['cuda_graphs'] else 'off'}; decode step (weights + KV read per step):"
        )
        print(f"{'batch':>6}{'context':>9}{'seqs/step':>11}{'step ms':>10}{'GB/s':>9}{'% copy bw':>11}")
        for ctx in contexts:
            for b in batches:
                if b * (ctx + 64) > num_blocks * 16:
                    continue
                s, seqs, mean_ctx = decode_step(core, b, ctx, 5 if quick else 30)
                moved = decode_params * elem + seqs * mean_ctx * kv_per_token  # what the step attends
                rows.append(
                    {
                        "batch": b,
                        "context": ctx,
                        "seqs_per_step": seqs,
                        "mean_context": mean_ctx,
                        "step_s": s,
                        "bytes_per_s": moved / s,
                        "pct_copy_bw": 100 * moved / s / bw,
                    }
                )
                print(
                    f"{b:>6}{ctx:>9}{seqs:>11.1f}{s * 1e3:>10.2f}{moved / s / 1e9:>9.1f}"
                    f"{100 * moved / s / bw:>10.0f}%"
                )
        out["decode"] = rows
        # Decode steps again with their host CPU, then the same batch with one new prompt a step
        # (CPU time includes the host's wait for the GPU: a CUDA sync spins by default), replayed
        # from the decode graphs and launched eagerly; then a conversation's next turn over a long
        # cached prefix, near the most prompt keys a replayed step may read (cuda_graphs.MIXED_BUDGET).
        n = 5 if quick else 30
        fits = [b for b in batches if b > 1 and b * (contexts[0] + 64) <= num_blocks * 16]
        print(f"\nmixed steps (batch - 1 decodes + one 16-token prompt) at context {contexts[0]}:")
        mixed_rows = mixed_table(core, fits, contexts[0], n, 16, 0)
        turn, cached = (16, 48) if quick else (128, 3840)
        print(f"\nthe same with a {turn}-token turn over a cached {cached}-token prefix:")
        prefix_caching(core, True)
        mixed_rows += mixed_table(core, fits, contexts[0], n, turn, cached)
        prefix_caching(core, False)
        out["mixed"] = mixed_rows
        prefill_rows = []
        print("\nprefill:")
        for length in [128] if quick else [512, 2048]:
            rate = prefill_rate(core, 4 if quick else 64, length)
            att = 2 * 2 * shape["num_hidden_layers"] * shape["hidden_size"] * length / 2  # per token, causal
            flops = rate * (2 * layer_params + att)
            prefill_rows.append(
                {"length": length, "tokens_per_s": rate, "flops": flops, "pct_matmul": 100 * flops / mm}
            )
            print(
                f"  {length}-token prompts: {rate:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s = {100 * flops / mm:.0f}% of matmul"
            )
        out["prefill"] = prefill_rows
        if a.profile:
            prof = out["profile"] = profile_decode(core, *a.profile, steps=10)
            print(
                f"\nprofile, batch {prof['batch']} context {prof['context']}: step {prof['step_s'] * 1e3:.2f} ms, "
                f"GPU kernels {prof['gpu_kernel_s_per_step'] * 1e3:.2f} ms ({prof['gpu_busy_pct']:.0f}% busy)"
            )
            for k in prof["top_kernels"]:
                print(f"  {k['s_per_step'] * 1e3:8.3f} ms {k['launches_per_step']:6.0f}x  {k['kernel'][:90]}")
            print("host functions by own time (cProfile, its overhead included):")
            for h in prof["host_self_s_per_step"]:
                print(f"  {h['s_per_step'] * 1e3:8.3f} ms  {h['function'][:100]}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
