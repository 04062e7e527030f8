"""Host time per decode step of the whole engine step, with a zero-cost model on CPU.

``EngineCore.step()`` runs for real (schedule, batch preparation, model, sampling, output
processing) around ``engine.models.zero_cost`` (no layer, no attention: a gather and a scatter), so
a step's time is what the engine adds to every step of a real model. For each batch x context,
``batch`` sequences of ``context`` prompt tokens are prefilled first (``prefill_first``), a few
decode steps warm up, then ``steps`` decode steps are timed with ``perf_counter``: the step, and
inside it ``scheduler.schedule``, the runner (``launch`` + ``collect``) and ``scheduler.update`` (the rest of
``step()`` is "other").

    python -m bench.host_overhead [--batches 1,32,256] [--contexts 128,1024,4096,8192]
        [--baseline-ref HEAD] [--json PATH] [--profile 20] [--overlap] [--engine-process] [--rounds 5]

``--rounds N`` measures the grid N times, the shapes forward then backward, and reports each figure's
median over the rounds: on this VM one pass each put batch 256's 8k / 128 context step at 0.67x,
0.89x and 1.53x in three runs minutes apart (the machine's speed, not the engine's).

``--engine-process`` times each step as the engine process runs it (``worker/engine_process.py``):
the step, then its outputs encoded for the pipe to the worker (the encode counts as "other").

``--baseline-ref REV`` measures the same grid on another revision too (``git archive`` into a
temporary directory) and prints new / old. Each side runs this file in a subprocess with that
side's ``engine`` package first on ``PYTHONPATH``. A revision without the zero-cost model builds
its engine from a tiny random checkpoint and has its runner's model replaced by this tree's
``ZeroCostForCausalLM`` (loaded from its file), which needs only interfaces both have:
``core.runner.model`` (``forward`` / ``compute_logits``), ``core.scheduler`` and ``core.step()``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import math
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadgen.vllm_result import percentile

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5
VOCAB = 512
BLOCK_SIZE = 16
ADMISSION_MARGIN = 0.01  # EngineConfig's default


# The engine under test ---------------------------------------------------------------------------


def _own_zero_cost():
    """This tree's ``engine/models/zero_cost.py``, loaded from its file: the engine under test may
    be a revision without it (it needs only torch, and ``engine.models.llama`` for specs)."""
    spec = importlib.util.spec_from_file_location("_bench_zero_cost", ROOT / "engine/models/zero_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_checkpoint(workdir: Path, max_len: int, swap: bool) -> tuple[Path, str]:
    """(checkpoint, mode): a zero-cost checkpoint where the engine under test loads one, else a
    tiny random one of the same KV layout whose model ``build_engine`` swaps out."""
    if not swap:
        try:
            from engine.models.zero_cost import create_zero_cost_model

            return create_zero_cost_model(workdir / "zero-cost", VOCAB, max_len), "zero-cost checkpoint"
        except ImportError:
            pass
    from engine.tiny_model import create_tiny_model

    path = create_tiny_model(
        workdir / "tiny",
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=max_len,
    )
    return path, "tiny checkpoint, zero-cost model swapped in"


def build_engine(
    checkpoint: Path, swap: bool, batch: int, max_len: int, blocks: int, policy="prefill_first", **kw
):
    """``kw``: more engine options (the attention backend, whose per-step metadata a GPU engine
    builds; async_scheduling where asked); ``policy``: fifo where requests arrive while others decode."""
    from engine import EngineConfig, EngineCore

    core = EngineCore(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_blocks=blocks,
            max_model_len=max_len,
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, min(batch * max_len, 16384)),
            scheduling_policy=policy,
            **kw,
        )
    )
    if swap:
        model = _own_zero_cost().ZeroCostForCausalLM.from_spec(core.runner.model.spec)
        core.runner.model = core.model = model
    return core


# One shape ---------------------------------------------------------------------------------------


def _timed(fn, acc: list[float], depth: list[int] | None = None):
    """``fn`` timed into ``acc``. Wrappers sharing ``depth`` time only the outermost call: the
    runner's ``launch`` calls ``collect`` itself when the step does not overlap, and counting that
    twice made the parts add up to more than the step."""
    clock = time.perf_counter
    depth = depth if depth is not None else [0]

    def wrapper(*args, **kwargs):
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0] += 1
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.append(clock() - t)
            depth[0] -= 1

    return wrapper


def _prefill(core, batch: int, context: int, max_tokens: int) -> None:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    n = VOCAB - 3
    for i in range(batch):  # distinct first blocks: no prefix sharing between sequences
        core.add_request(f"s{i}", [3 + (7 * i + j) % n for j in range(context)], params)
    while any(r.num_computed_tokens < r.prompt_len for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(WARMUP_STEPS):
        produced = sum(len(o.new_token_ids) for o in core.step())
    if produced != batch:
        raise RuntimeError(f"{produced} of {batch} sequences are decoding after the prefill")


def _profile(step, steps: int, top: int) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{name} ({Path(f).name}:{line})",
            "own_ms_per_step": v[2] * 1e3 / steps,
            "cum_ms_per_step": v[3] * 1e3 / steps,
            "calls_per_step": v[0] / steps,
        }
        for (f, line, name), v in rows
    ]


def channel_step(core):
    """A step as the engine process runs it: the step, then its outputs encoded for the channel to
    its worker, the plain ones as the columns the engine kept where the tree keeps them so. Returns
    the tokens it produced."""
    from proto import pdserve_pb2 as pb
    from worker.engine_channel import outputs_from_proto, outputs_to_proto

    try:
        from engine.scheduler_output import PlainTokens
    except ImportError:  # a revision whose step returns objects only
        PlainTokens = None
    try:  # the channel's two ends, where it sends a steady batch's members once
        from worker.engine_channel import SteadyBatchReceiver, SteadyBatchSender

        ends = ((SteadyBatchSender(),), (SteadyBatchReceiver(),))
    except ImportError:
        ends = ((), ())

    def step() -> pb.EngineEvents:
        events = pb.EngineEvents()
        if PlainTokens is None:
            outputs_to_proto(core.step(), events)
        else:
            plain = PlainTokens()
            outputs_to_proto(core.step(plain), events, plain, None, *ends[0])
        events.SerializeToString()
        return events

    return step, lambda events: sum(len(o.new_token_ids) for o in outputs_from_proto(events, *ends[1]))


def measure(
    checkpoint: Path,
    swap: bool,
    batch: int,
    context: int,
    steps: int,
    profile: int = 0,
    engine_process: bool = False,
    **engine_args,
) -> dict:
    """One shape: prefill, warm up, then ``steps`` timed decode steps (and ``profile`` more under
    cProfile); ``engine_process``: each step with its outputs encoded as the engine process sends
    them (``channel_step``)."""
    max_tokens = WARMUP_STEPS + steps + profile + 4
    max_len = context + max_tokens
    # Every sequence's whole length, over the 1% the scheduler keeps free when it admits.
    num_blocks = math.ceil(batch * -(-max_len // BLOCK_SIZE) / (1 - ADMISSION_MARGIN)) + 8
    core = build_engine(checkpoint, swap, batch, max_len, num_blocks, **engine_args)
    _prefill(core, batch, context, max_tokens)
    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "update": []}
    sched, runner = core.scheduler, core.runner
    sched.schedule = _timed(sched.schedule, parts["schedule"])
    # The runner's share: launch + collect where the engine splits its steps (overlapped scheduling),
    # execute in older trees.
    runner_calls = ("launch", "collect") if hasattr(runner, "launch") else ("execute",)
    nested = [0]
    for name in runner_calls:
        setattr(runner, name, _timed(getattr(runner, name), parts["execute"], nested))
    sched.update = _timed(sched.update, parts["update"])
    step_s: list[float] = []
    clock = time.perf_counter
    step, produced = (
        channel_step(core)
        if engine_process
        else (core.step, lambda outs: sum(len(o.new_token_ids) for o in outs))
    )
    first, by_slot = sched.running[0], {}  # every sequence's position moves with the first's
    gc.collect()
    for _ in range(steps):
        slot = first.num_computed_tokens % BLOCK_SIZE
        t0 = clock()
        outs = step()
        step_s.append(clock() - t0)
        by_slot.setdefault(slot, []).append(step_s[-1] * 1e3)
        if produced(outs) != batch:
            raise RuntimeError(f"a step produced tokens for fewer than {batch} sequences")
    for name in ("schedule", "update"):
        delattr(sched, name)
    for name in runner_calls:
        delattr(runner, name)
    top = _profile(step, profile, 15) if profile else []  # as timed: the engine process's step too
    ms = sorted(s * 1e3 for s in step_s)
    mean = {k: sum(v) / steps * 1e3 for k, v in parts.items()}  # per step (the runner: two calls)
    row = {
        "batch": batch,
        "context": context,
        "steps": steps,
        "mean_ms": statistics.fmean(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": percentile(ms, 90),
        "schedule_ms": mean["schedule"],
        "execute_ms": mean["execute"],
        "update_ms": mean["update"],
        "other_ms": statistics.fmean(ms) - sum(mean.values()),
        # By the block slot the step's token takes (the last fills every block, the first opens one)
        "by_slot_p50_ms": {k: statistics.median(v) for k, v in sorted(by_slot.items())},
    }
    if top:
        row["profile_top"] = top
    return row


def median_row(rows: list[dict]) -> dict:
    """One shape's rounds as one row: each figure the median over the rounds (each slot's too), the
    rounds' means kept (``round_mean_ms``)."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    for key, value in rows[0].items():
        if key.endswith("_ms") and isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
    slots = rows[0]["by_slot_p50_ms"]
    out["by_slot_p50_ms"] = {k: statistics.median(r["by_slot_p50_ms"][k] for r in rows) for k in slots}
    out["round_mean_ms"] = [r["mean_ms"] for r in rows]
    return out


def steps_for(batch: int, max_steps: int, token_budget: int) -> int:
    """Fewer steps at large batches (but ten at least): the default grid stays within a few minutes
    on 2 cores."""
    return min(max_steps, max(10, token_budget // batch))


def run_grid(args) -> dict:
    """Every batch x context of ``args`` on the ``engine`` package this process imports."""
    import torch

    import engine

    torch.set_num_threads(args.threads)
    shapes = [(b, c) for b in args.batches for c in args.contexts]
    max_len = max(args.contexts) + WARMUP_STEPS + args.steps + args.profile + 4
    # The model never attends, so the backend's only cost is its per-step metadata: a GPU engine's
    # (triton) unless asked; an older tree has no async_scheduling, so it is passed only when on.
    engine_args = {"attention_backend": args.attention_backend}
    if args.overlap:
        engine_args["async_scheduling"] = "on"
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, mode = make_checkpoint(Path(tmp), max_len, args.force_swap)
        swap = mode != "zero-cost checkpoint"
        rounds: list[dict] = []
        # Each round takes the shapes in the other order: a machine whose speed drifts (this VM's
        # moves 1.4x within minutes) tilts no shape against another in the median.
        order = [s for r in range(args.rounds) for s in (shapes if r % 2 == 0 else shapes[::-1])]
        for batch, context in _progress(order):
            if not rounds or (batch, context) in rounds[-1]:
                rounds.append({})
            steps = steps_for(batch, args.steps, args.token_budget)
            rounds[-1][batch, context] = measure(
                checkpoint, swap, batch, context, steps, args.profile, args.engine_process, **engine_args
            )
        rows = [median_row([r[shape] for r in rounds]) for shape in shapes]
    return {
        "engine": str(Path(engine.__file__).resolve().parents[1]),
        "mode": mode,
        "torch_threads": torch.get_num_threads(),
        "async_scheduling": args.overlap,
        "engine_process": args.engine_process,
        "rows": rows,
    }


def _progress(shapes: list[tuple[int, int]]):
    """tqdm on stderr where installed, else a line per shape."""
    try:
        from tqdm import tqdm

        yield from tqdm(shapes, desc="host overhead", file=sys.stderr, leave=False)
    except ImportError:
        for i, (batch, context) in enumerate(shapes):
            print(f"[{i + 1}/{len(shapes)}] batch {batch} x {context}", file=sys.stderr, flush=True)
            yield batch, context


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=_ints, default=[1, 32, 256])
    parser.add_argument("--contexts", type=_ints, default=[128, 1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per shape (at most)")
    parser.add_argument(
        "--token-budget", type=int, default=25600, help="fewer steps where batch x steps exceeds this"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: a GPU engine's policy, engine.cpu_threads; more makes a 2-core "
        "machine's steps wait on OpenMP wake-ups)",
    )
    parser.add_argument("--profile", type=int, default=0, help="this many more steps under cProfile")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the grid this many times, the shapes in turn forward and backward; report each "
        "figure's median over the rounds",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="the engine with async_scheduling on (overlapped steps; a baseline's too)",
    )
    parser.add_argument(
        "--attention-backend",
        default="triton",
        choices=["triton", "torch"],
        help="whose per-step metadata the engine builds (triton: a GPU engine's; torch: a CPU engine's, whose "
        "decode masks grow with context)",
    )
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="each step as the engine process runs it: its outputs encoded for the channel to its worker",
    )
    parser.add_argument("--target-ms", type=float, default=0.3, help="the goal at batch 256 x 4k")
    parser.add_argument("--baseline-ref", default=None, help="also measure this git revision; print new/old")
    parser.add_argument(
        "--force-swap", action="store_true", help="tiny checkpoint + swapped model on this tree too"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.token_budget, args.threads, args.rounds) < 1 or args.profile < 0:
        parser.error(
            "--steps, --token-budget, --threads and --rounds must be positive, --profile non-negative"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:  # one side of a comparison: rows to --json, progress to stderr
        args.json.write_text(json.dumps(run_grid(args)))
        return {}
    from bench.host_overhead_report import format_report, ratios  # not in a baseline's tree
    from bench.host_overhead_revisions import run_against

    result = run_against(args) if args.baseline_ref else {"current": run_grid(args)}
    if args.baseline_ref:
        result["ratios"] = ratios(result["current"]["rows"], result["baseline"]["rows"])
    print(format_report(result, args.target_ms))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file: the engine comes from PYTHONPATH, not bench/
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()
