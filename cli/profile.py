"""``pdserve profile``: measure a model's prefill, decode and KV transfer costs on this machine's
engine and store them as JSON, the input of the P/D planner (``planner.profile``, issue 34)."""

from __future__ import annotations

import argparse
import sys

from cli.tiny_model import ensure_tiny_model
from engine.args import add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure a model's costs on this hardware for the planner (JSON)")
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--quick", action="store_true", help="a small grid: seconds on a CPU, for a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="runs per sample, after a warm-up (default 3)")
    p.add_argument(
        "--no-transfer", dest="transfer", action="store_false", help="skip the NIXL KV transfer measurement"
    )
    p.add_argument(
        "--served",
        metavar="URL",
        help="instead of the engine: measure what the running deployment at URL adds to the engine's "
        "steps (front end, router, hops, streaming) and store it in the existing profile --out, for "
        "the deployment's --served-mode (the API key from PDSERVE_API_KEY)",
    )
    p.add_argument(
        "--served-mode",
        choices=("aggregated", "disaggregated"),
        help="the serving mode of the deployment --served measures (required with --served)",
    )
    add_engine_args(
        p,
        model_required=False,
        model_help="checkpoint directory or Hugging Face id (default: a tiny random Llama)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from engine import EngineCore
    from planner.profile import Grid, profile_engine

    if args.served:
        ignored = _engine_flags_given(args)
        if ignored:  # they shape the engine's measurement; --served measures a running deployment
            verb = "does" if len(ignored) == 1 else "do"
            raise ValueError(
                f"{', '.join(ignored)} {verb} not apply with --served (it measures the deployment)"
            )
        return _served(args)
    if args.served_mode:
        raise ValueError("--served-mode goes with --served URL")
    _check_writable(args.out)  # before minutes of measuring, not after
    model = args.model or str(ensure_tiny_model())
    grid = Grid.default(quick=args.quick)
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        grid = replace(grid, repeats=args.repeats)
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    core = EngineCore(engine_config_from_args(args, model))

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    profile = profile_engine(core, model, grid, transfer=args.transfer, progress=progress)
    _save(profile, args.out)
    for name, curve in (
        ("prefill", profile.prefill),
        ("decode", profile.decode),
        ("transfer", profile.transfer),
    ):
        if curve is None:
            print(f"{name}: not measured")
            continue
        terms = ", ".join(f"{t} {c:.3g}" for t, c in zip(curve.terms, curve.coef, strict=True))
        print(f"{name}: {terms}; fit error mean {curve.mean_rel_error:.1%}, max {curve.max_rel_error:.1%}")
    for warning in profile.fit_warnings():
        print(f"warning: {warning}", file=sys.stderr)
    print(f"profile written to {args.out}")
    return 0


def _served(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from urllib.parse import urlsplit

    from planner import host_cpu
    from planner.costs import ModelProfile
    from planner.served import Client, fit_warning, measure_served
    from settings import environment

    if not args.served_mode:
        raise ValueError("--served needs --served-mode (aggregated or disaggregated): the deployment's mode")
    profile = ModelProfile.load(args.out)  # the engine's profile, measured first
    client = Client(args.served, environment.api_key())
    print(
        f"measuring {args.served} ({client.model}) against the engine profile {args.out} ...", file=sys.stderr
    )
    # A deployment on this machine shares its cores with the front end: measure the front end's CPU.
    local = host_cpu.available() and urlsplit(args.served).hostname in ("127.0.0.1", "localhost", "::1")
    over = measure_served(
        client,
        profile,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
        host_usage=host_cpu.usage if local else None,
    )
    _save(replace(profile, served={**profile.served, args.served_mode: over}), args.out)
    warning = fit_warning(over)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"served path ({args.served_mode}): {over.ttft_s * 1e3:.2f} ms + "
        f"{over.per_token_s * 1e6:.1f} us per prompt token before the first token, prompts computed "
        f"{over.prefill_scale:.0%} slower than the engine alone, "
        f"{over.step_s * 1e3:.2f} ms + {over.step_per_seq_s * 1e3:.3f} ms per sequence per decode step"
    )
    if local:
        print(
            f"front end CPU on this host: {over.cpu_per_request_s * 1e3:.2f} ms per request, "
            f"{over.cpu_per_token_s * 1e3:.3f} ms per streamed token; a busy engine process keeps "
            + (f"{over.engine_cores:.2f} cores busy" if over.engine_cores else "no engine process found")
        )
    print(f"profile written to {args.out}")
    return 0


def _engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The engine-measurement flags given that differ from their defaults."""
    import dataclasses

    from engine.args import engine_options, flag_name

    given = ["--quick"] * args.quick + ["--repeats"] * (args.repeats is not None)
    given += ["--no-transfer"] * (not args.transfer)
    given += ["--model"] * (args.model is not None)
    for f in engine_options():
        if f.name == "model":
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if getattr(args, f.name) != default:
            given.append(flag_name(f.name))
    return given


def _check_writable(path: str) -> None:
    import os

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"--out {path}: no directory {directory}")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--out {path}: not writable")


def _save(profile, path: str) -> None:
    try:
        profile.save(path)
    except OSError as exc:
        raise ValueError(f"cannot write the profile to {path}: {exc.strerror or exc}") from exc
