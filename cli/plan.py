"""``pdserve plan``: how many prefill and decode replicas (and which local-prefill threshold) serve a
traffic within its SLOs, from a measured profile (``pdserve profile``) and the simulator (issue 34)."""

from __future__ import annotations

import argparse
import json
import math
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="recommend prefill/decode replica counts for a traffic and its SLOs")
    p.add_argument("--profile", required=True, help="a profile written by pdserve profile (JSON)")
    p.add_argument("--traffic", required=True, help="the traffic description (YAML/JSON; see the docs)")
    p.add_argument("--max-workers", type=int, default=8, help="GPUs (prefill + decode workers) at most")
    p.add_argument("--rate-scale", type=float, default=1.0, help="what if: this many times the arrivals")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="what if: prompts this many times longer")
    p.add_argument(
        "--shared-cores",
        type=int,
        default=None,
        help="the workers share this many cores of one host (a CPU deployment; default: a device each)",
    )
    p.add_argument("--model", default=None, help="check the profile is of this model (directory or HF id)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.costs import ModelProfile
    from planner.plan import plan
    from planner.traffic import load_traffic

    profile = ModelProfile.load(args.profile)
    if args.model:
        profile.check_model(_identity(args.model))
    for warning in profile.fit_warnings():
        print(f"warning: {args.profile}: {warning}", file=sys.stderr)
    for name in ("rate_scale", "prompt_scale"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    traffic = load_traffic(args.traffic).scaled(args.rate_scale, args.prompt_scale)

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    if args.shared_cores is not None and args.shared_cores < 1:
        raise ValueError(f"--shared-cores must be at least 1, got {args.shared_cores}")
    best, seen = plan(profile, traffic, args.max_workers, progress, host_cores=args.shared_cores)
    d, s = best.deployment, best.summary
    if args.json:
        print(
            json.dumps(
                {
                    "prefill": d.prefill,
                    "decode": d.decode,
                    "local_prefill_tokens": d.local_prefill_tokens,
                    "predicted": s.as_dict(),
                    "evaluated": len(seen),
                }
            )
        )
        return 0
    rate = best.arriving if math.isfinite(best.arriving) else traffic.rate  # the simulated arrivals'
    print(f"recommended: {best.describe()} ({best.workers} workers) for {rate:.2f} req/s")
    print(
        f"predicted: TTFT p50 {s.ttft_p50:.3f} s, p90 {s.ttft_p90:.3f} s; ITL p50 {s.itl_p50 * 1e3:.1f} ms, "
        f"p90 {s.itl_p90 * 1e3:.1f} ms; throughput {s.throughput:.2f} req/s, goodput {s.goodput:.2f} req/s"
    )
    flags = (
        f"--prefill {d.prefill} --decode {d.decode}"
        if d.prefill
        else f"--mode aggregated --decode {d.decode}"
    )
    if d.prefill:
        flags += f" --local-prefill-tokens {d.local_prefill_tokens}"
    print(f"serve it with: pdserve serve {flags} (and the engine flags you profiled with)")
    return 0


def _identity(model: str) -> dict:
    """The shape fields a profile names, read from the model's config (no weights loaded)."""
    from engine.models.loader import load_hf_config, resolve_model_path

    cfg = load_hf_config(resolve_model_path(model))  # a ValueError (one line) when it cannot load
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    return {
        "architecture": (cfg.architectures or [""])[0],
        "num_layers": layers,
        "hidden_size": cfg.hidden_size,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    }
