"""Argument types of ``pdserve bench``'s flags: a value the load generator cannot use is refused by
argparse, in one line that names the flag (``argument --max-concurrency: must be at least 1, got
0``), before anything is sent. Unchecked, such values hung (no client at concurrency <= 0), raised
from deep inside (a gamma shape of 0, a URL without its scheme) or labelled a run "concurrency 0"."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def request_rate(text: str) -> float:
    """Arrivals per second; a closed loop is the flag left out, so 0 is refused rather than read as one."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0, got {text} (leave --request-rate out for a closed loop)"
        )
    return value


def concurrency_levels(text: str) -> list[int]:
    """``--sweep 1,4,16``: distinct levels of at least 1 (a level's results file is named after it)."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, e.g. 1,4,16, got {text!r}"
        ) from None
    if min(levels) < 1:
        raise argparse.ArgumentTypeError(f"every level must be at least 1, got {text}")
    if len(set(levels)) < len(levels):
        raise argparse.ArgumentTypeError(f"a level is given twice in {text}")
    return levels


def goodput_slo(text: str) -> tuple[str, float]:
    """One ``--goodput`` SLO: ``ttft:MS``, ``tpot:MS`` or ``e2e:MS`` (``e2el:MS``, vLLM's name,
    too), as (name, milliseconds)."""
    name, _, value = text.partition(":")
    name = "e2e" if name == "e2el" else name
    try:
        ms = float(value)
    except ValueError:
        ms = 0.0
    if name not in ("ttft", "tpot", "e2e") or not (ms > 0 and math.isfinite(ms)):
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2e:MS with MS > 0, got {text!r}")
    return name, ms


def base_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"needs http:// or https:// and a host, e.g. http://127.0.0.1:8000, got {text!r}"
        )
    return text
