"""Command-line flags for an ``EngineConfig``, derived from its option declarations.

Every field of ``EngineConfig`` becomes ``--field-name`` with the declared default, help and
choices; booleans get ``--x`` / ``--no-x``. Entry points that run an engine (the workers,
``pdserve generate``, ``pdserve serve``) all call ``add_engine_args``, so they list the same options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from engine.config import EngineConfig

_TYPES = {"int": int, "float": float, "str": str, "dict": dict}


def engine_options() -> list[dataclasses.Field]:
    """The declared engine options, ``model`` first."""
    return list(dataclasses.fields(EngineConfig))


def option_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(the option's Python type, whether it may be None) from its annotation."""
    parts = [p.strip() for p in str(f.type).split("|")]
    optional = "None" in parts
    base = next(p for p in parts if p != "None")
    if base == "bool":
        return bool, optional
    return _TYPES.get(base, str), optional  # e.g. ``str | torch.dtype``: given as a name


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(
    parser: argparse.ArgumentParser, *, model_required: bool = True, model_help: str | None = None
) -> None:
    g = parser.add_argument_group("engine")
    for f in engine_options():
        help_text = f.metadata.get("help", "")
        if f.name == "model":
            g.add_argument("--model", required=model_required, default=None, help=model_help or help_text)
            continue
        typ, _ = option_type(f)
        names = [flag_name(f.name)]
        if "flag" in f.metadata:
            names.append(f.metadata["flag"])
        if typ is bool:
            g.add_argument(
                *names, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction, help=help_text
            )
            continue
        if f.name == "lora_modules":  # also one adapter at a time: --lora NAME=PATH, repeatable
            g.add_argument(
                "--lora",
                dest=f.name,
                action=_LoraAction,
                metavar="NAME=PATH",
                help="a LoRA adapter (PEFT format) to serve as NAME; repeat for more",
            )
        default_note = "" if f.default is None else f" (default: {f.default})"
        g.add_argument(
            *names,
            dest=f.name,
            type=_json_object if typ is dict else typ,
            default=f.default,
            choices=f.metadata.get("choices"),
            help=help_text + default_note,
            **({"action": _LoraModulesAction} if f.name == "lora_modules" else {}),
        )


def _add_adapters(parser, namespace, dest: str, adapters: dict, option_string: str) -> None:
    """``adapters`` added to those given so far (``--lora`` and ``--lora-modules`` add up); a name
    given twice is an error, not a silent replacement."""
    have = getattr(namespace, dest) or {}
    if twice := sorted(set(have) & set(adapters)):
        parser.error(f"{option_string}: the LoRA adapter {twice[0]!r} is given twice")
    setattr(namespace, dest, {**have, **adapters})


class _LoraAction(argparse.Action):
    """``--lora NAME=PATH``: adds one adapter to ``lora_modules``."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            parser.error(f"{option_string} takes NAME=PATH, got {value!r}")
        _add_adapters(parser, namespace, self.dest, {name: path}, option_string)


class _LoraModulesAction(argparse.Action):
    """``--lora-modules JSON``: adds its adapters to ``lora_modules``."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        _add_adapters(parser, namespace, self.dest, value, option_string)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every engine option from parsed flags, except ``model``."""
    return {f.name: getattr(args, f.name) for f in engine_options() if f.name != "model"}


def engine_config_from_args(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    return EngineConfig(model=model or args.model, **engine_kwargs_from_args(args))
