"""A traffic description for the planner: arrivals, prompt and output lengths, prefix sharing, SLOs;
or a trace of real requests (issue 34). Every field is checked, and an error names it.

YAML or JSON, e.g.::

    rate: 4.0                      # requests per second, Poisson arrivals
    requests: 600                  # how many to simulate (or duration_s)
    prompt_tokens: {mean: 1024, spread: 0.5}   # uniform in mean x (1 +- spread); or a number
    output_tokens: 128
    prefix: {groups: 8, tokens: 512}           # each prompt opens with one of 8 shared 512-token prefixes
    slo: {ttft_p90_s: 1.0, itl_p50_s: 0.05}
    seed: 0

or ``trace: requests.jsonl`` with one ``{"arrival_s", "prompt_tokens", "output_tokens"}`` object per line
(optional ``"prefix_group"`` and ``"prefix_tokens"``), SLOs as above.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from planner.simulator import SimRequest


class TrafficError(ValueError):
    """A traffic description or trace that cannot be used."""


@dataclass(frozen=True)
class Lengths:
    mean: float
    spread: float = 0.0  # uniform in mean * (1 +- spread)

    def draw(self, rng: random.Random) -> int:
        lo, hi = self.mean * (1 - self.spread), self.mean * (1 + self.spread)
        return max(1, round(rng.uniform(lo, hi)))


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float | None = None
    itl_p50_s: float | None = None


@dataclass(frozen=True)
class Traffic:
    rate: float
    requests: int
    prompt: Lengths
    output: Lengths
    prefix_groups: int = 0
    prefix_tokens: int = 0
    slo: SLO = SLO()
    seed: int = 0
    trace: tuple[dict, ...] = ()  # when given: these requests, not the generated ones

    @classmethod
    def from_dict(cls, d: dict) -> Traffic:
        """The inverse of ``dataclasses.asdict`` (a description stored with a result)."""
        parts = {"prompt": Lengths(**d["prompt"]), "output": Lengths(**d["output"]), "slo": SLO(**d["slo"])}
        return cls(**(d | parts | {"trace": tuple(d.get("trace", ()))}))

    def scaled(self, rate: float = 1.0, prompt: float = 1.0) -> Traffic:
        """What if: ``rate`` times the arrivals, prompts ``prompt`` times as long."""
        from dataclasses import replace

        trace = tuple(
            {
                **t,
                "arrival_s": t["arrival_s"] / rate,
                "prompt_tokens": max(1, round(t["prompt_tokens"] * prompt)),
            }
            for t in self.trace
        )
        return replace(
            self,
            rate=self.rate * rate,
            prompt=Lengths(self.prompt.mean * prompt, self.prompt.spread),
            prefix_tokens=round(self.prefix_tokens * prompt),
            trace=trace,
        )

    def generate(self, vocab: int = 32000) -> list[SimRequest]:
        """The requests to simulate, the same for the same description (seeded); token ids below
        ``vocab`` (what they are matters only to prefix sharing, and to a real server replaying them)."""
        rng = random.Random(self.seed)
        prefixes = [
            [rng.randrange(10, vocab) for _ in range(self.prefix_tokens)] for _ in range(self.prefix_groups)
        ]
        if self.trace:
            groups: dict = {}
            out = []
            for t in self.trace:
                head: list[int] = []
                if "prefix_group" in t:
                    key = (t["prefix_group"], t.get("prefix_tokens", 0))
                    head = groups.setdefault(key, [rng.randrange(10, vocab) for _ in range(key[1])])
                rest = [rng.randrange(10, vocab) for _ in range(max(1, t["prompt_tokens"] - len(head)))]
                out.append(SimRequest(t["arrival_s"], head + rest, t["output_tokens"]))
            return out
        t, out = 0.0, []
        for _ in range(self.requests):
            t += rng.expovariate(self.rate)
            head = rng.choice(prefixes) if prefixes else []
            rest = [rng.randrange(10, vocab) for _ in range(max(1, self.prompt.draw(rng) - len(head)))]
            out.append(SimRequest(t, head + rest, self.output.draw(rng)))
        return out


def load_traffic(path: str | Path) -> Traffic:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise TrafficError(f"cannot read the traffic description {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise TrafficError(f"the traffic description {path} is not YAML or JSON: {exc}") from None
    return parse_traffic(data, base=Path(path).parent)


def parse_traffic(data, base: Path = Path(".")) -> Traffic:
    if not isinstance(data, dict):
        raise TrafficError("a traffic description is a mapping (rate, requests, prompt_tokens, ...)")
    known = {
        "rate",
        "requests",
        "duration_s",
        "prompt_tokens",
        "output_tokens",
        "prefix",
        "slo",
        "seed",
        "trace",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise TrafficError(
            f"unknown traffic field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    slo = _slo(data.get("slo"))
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TrafficError(f"seed must be an integer, got {seed!r}")
    if "trace" in data:
        trace = _trace(base / str(data["trace"]))
        span = trace[-1]["arrival_s"] - trace[0]["arrival_s"]
        rate = len(trace) / span if span > 0 else float(len(trace))
        mean_in = sum(t["prompt_tokens"] for t in trace) / len(trace)
        mean_out = sum(t["output_tokens"] for t in trace) / len(trace)
        return Traffic(
            rate, len(trace), Lengths(mean_in), Lengths(mean_out), slo=slo, seed=seed, trace=tuple(trace)
        )
    rate = _number(data, "rate")
    if "requests" in data:
        requests = data["requests"]
        if not isinstance(requests, int) or isinstance(requests, bool) or requests < 1:
            raise TrafficError(f"requests must be a positive integer, got {requests!r}")
    elif "duration_s" in data:
        requests = max(1, round(_number(data, "duration_s") * rate))
    else:
        raise TrafficError("give requests (how many) or duration_s (how long) with rate")
    prefix = data.get("prefix") or {}
    if not isinstance(prefix, dict) or set(prefix) - {"groups", "tokens"}:
        raise TrafficError("prefix must be {groups: N, tokens: T}")
    groups, tokens = prefix.get("groups", 0), prefix.get("tokens", 0)
    for name, v in (("prefix.groups", groups), ("prefix.tokens", tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise TrafficError(f"{name} must be a non-negative integer, got {v!r}")
    prompt = _lengths(data, "prompt_tokens")
    # A prompt as long as the prefix still gets a token of its own (``generate``): equal is fine.
    if tokens and tokens > prompt.mean * (1 - prompt.spread):
        raise TrafficError(f"prefix.tokens ({tokens}) must not be longer than the shortest prompt")
    return Traffic(rate, requests, prompt, _lengths(data, "output_tokens"), groups, tokens, slo, seed)


def _number(data: dict, name: str) -> float:
    v = data.get(name)
    if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
        raise TrafficError(f"{name} must be a positive number, got {v!r}")
    return float(v)


def _lengths(data: dict, name: str) -> Lengths:
    v = data.get(name)
    if isinstance(v, dict):
        if set(v) - {"mean", "spread"}:
            raise TrafficError(f"{name} takes mean and spread, got {sorted(v)}")
        mean = _number(v, "mean")
        spread = v.get("spread", 0.0)
        if not isinstance(spread, int | float) or not 0 <= spread < 1:
            raise TrafficError(f"{name}.spread must be in [0, 1), got {spread!r}")
        return Lengths(mean, float(spread))
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise TrafficError(f"{name} must be a positive integer or {{mean, spread}}, got {v!r}")
    return Lengths(float(v))


def _slo(v) -> SLO:
    if v is None:
        return SLO()
    if not isinstance(v, dict) or set(v) - {"ttft_p90_s", "itl_p50_s"}:
        raise TrafficError("slo takes ttft_p90_s and itl_p50_s (seconds)")
    for k, x in v.items():
        if not isinstance(x, int | float) or isinstance(x, bool) or not x > 0:
            raise TrafficError(f"slo.{k} must be a positive number of seconds, got {x!r}")
    return SLO(v.get("ttft_p90_s"), v.get("itl_p50_s"))


def _trace(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TrafficError(f"cannot read the trace {path}: {exc.strerror}") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            t = json.loads(line)
        except ValueError:
            raise TrafficError(f"trace {path.name} line {i} is not JSON") from None
        if not isinstance(t, dict):
            raise TrafficError(f"trace {path.name} line {i} must be an object")
        for k in ("arrival_s", "prompt_tokens", "output_tokens"):
            v = t.get(k)
            ok = (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and (v >= 0 if k == "arrival_s" else v >= 1)
            )
            if not ok or (k != "arrival_s" and not isinstance(v, int)):
                raise TrafficError(
                    f"trace {path.name} line {i}: {k} must be a {'time' if k == 'arrival_s' else 'positive integer'}, got {v!r}"
                )
        if out and t["arrival_s"] < out[-1]["arrival_s"]:
            raise TrafficError(f"trace {path.name} line {i}: arrivals must not go back in time")
        out.append(t)
    if not out:
        raise TrafficError(f"trace {path.name} has no requests")
    return out
