"""A model's costs on its hardware, as the planner uses them: measured samples, fitted cost curves, and
the JSON file ``pdserve profile`` writes and ``pdserve plan`` reads (issue 34).

Three curves, each linear in terms a serving engine's work grows with, fitted by least squares with
non-negative coefficients (a term that would come out negative is dropped and the rest refitted):

- prefill of ``new`` prompt tokens after ``cached`` ones already in the KV cache:
  ``base + per_token * new + per_token_ctx * new * (cached + new / 2)`` (the last term: attention to
  the context, half the new tokens on average);
- a decode step of ``batch`` sequences at mean context ``context``:
  ``base + per_seq * batch + per_seq_ctx * batch * context``;
- a KV transfer of ``nbytes``: ``base + per_byte * nbytes``.

A profile names the model it measured (architecture and KV shape) and the hardware; ``check_model``
refuses a profile of another model. Loading validates every field and says which one is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1


NOISY_FIT = 0.10  # a compute curve's mean relative error beyond which its profile is suspect


class ProfileError(ValueError):
    """A profile that cannot be used: malformed, of another version, or of another model."""


@dataclass(frozen=True)
class Curve:
    """``sum(coef[i] * term_i)`` over named terms; ``max_rel_error``: the fit's worst relative error
    on its own samples (how far to trust it)."""

    terms: tuple[str, ...]
    coef: tuple[float, ...]
    max_rel_error: float = 0.0
    mean_rel_error: float = 0.0

    def value(self, features: list[float]) -> float:
        return float(sum(c * f for c, f in zip(self.coef, features, strict=True)))


def prefill_features(new: float, cached: float) -> list[float]:
    return [1.0, new, new * (cached + new / 2)]


def decode_features(batch: float, context: float) -> list[float]:
    return [1.0, batch, batch * context]


def transfer_features(nbytes: float) -> list[float]:
    return [1.0, nbytes]


PREFILL_TERMS = ("base_s", "per_token_s", "per_token_ctx_s")
DECODE_TERMS = ("base_s", "per_seq_s", "per_seq_ctx_s")
TRANSFER_TERMS = ("base_s", "per_byte_s")


def fit(terms: tuple[str, ...], rows: list[list[float]], seconds: list[float]) -> Curve:
    """Non-negative least squares over ``rows`` (one feature row per sample), relative errors weighted
    equally (each row scaled by 1 / its time, so short and long samples count alike)."""
    if len(rows) < len(terms):
        raise ProfileError(f"{len(rows)} samples cannot fit {len(terms)} terms ({', '.join(terms)})")
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if (y <= 0).any():
        raise ProfileError("every sample's time must be positive")
    w = 1.0 / y
    keep = list(range(len(terms)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))  # a negative coefficient: that term explains nothing here
    full = np.zeros(len(terms))
    full[keep] = np.clip(coef, 0.0, None)
    rel = np.abs(x @ full - y) / y
    return Curve(terms, tuple(float(c) for c in full), float(rel.max()), float(rel.mean()))


SERVED_MODES = ("aggregated", "disaggregated")


@dataclass(frozen=True)
class ServedOverhead:
    """What a deployment adds to the engine's steps, measured on it by ``pdserve profile --served``
    (``planner.served``): HTTP, tokenization, the router and the gRPC hops before the first token
    (``ttft_s``, and ``per_token_s`` per prompt token), a prompt's computation running
    ``prefill_scale`` slower than the engine alone measured it (the served worker shares its cores
    with the front end's processes), and each decode step's streaming out through worker, router
    and ingress (``step_s + step_per_seq_s * batch``); on the engines' own host, the front end's CPU
    and the cores a busy engine process keeps busy. ``samples``: the measurements these were fitted
    to."""

    ttft_s: float = 0.0
    step_s: float = 0.0
    step_per_seq_s: float = 0.0
    samples: tuple[dict, ...] = ()
    prefill_scale: float = 0.0  # served prefill time = engine prefill time * (1 + prefill_scale)
    per_token_s: float = 0.0  # the front end's time per prompt token, before the prompt reaches a worker
    # The front end's CPU on the engines' host (0: not measured, a remote deployment): per request
    # and per streamed token. On shared cores the simulator takes it from the engines.
    cpu_per_request_s: float = 0.0
    cpu_per_token_s: float = 0.0
    engine_cores: float = 0.0  # cores a busy engine process keeps busy (0: not measured)

    FIELDS = (
        "ttft_s",
        "step_s",
        "step_per_seq_s",
        "prefill_scale",
        "per_token_s",
        "cpu_per_request_s",
        "cpu_per_token_s",
        "engine_cores",
    )

    def intake_s(self, prompt_tokens: int) -> float:
        """A request's time in the front end before a worker sees it."""
        return self.ttft_s + self.per_token_s * prompt_tokens

    def request_cpu_s(self, prompt_tokens: int) -> float:
        """The front end's CPU for taking a request in; unmeasured, its intake time stands in."""
        measured = self.cpu_per_request_s or self.cpu_per_token_s
        return self.cpu_per_request_s if measured else self.intake_s(prompt_tokens)

    def token_cpu_s(self) -> float:
        """The front end's CPU per streamed token; unmeasured, the streaming time per sequence."""
        measured = self.cpu_per_request_s or self.cpu_per_token_s
        return self.cpu_per_token_s if measured else self.step_per_seq_s

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS} | {"samples": list(self.samples)}

    @classmethod
    def from_json(cls, data, where: str) -> ServedOverhead:
        if not isinstance(data, dict):
            raise ProfileError(f"profile field {where} must be an object")
        data = dict.fromkeys(cls.FIELDS[3:], 0.0) | data  # profiles written before these were measured
        for k in cls.FIELDS:
            v = data.get(k)
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise ProfileError(f"profile field {where}.{k} must be a number >= 0, got {v!r}")
        samples = data.get("samples", [])
        if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
            raise ProfileError(f"profile field {where}.samples must be a list of objects")
        return cls(**{k: data[k] for k in cls.FIELDS}, samples=tuple(samples))


@dataclass
class ModelProfile:
    """What ``pdserve profile`` measured, and the curves fitted to it."""

    model: dict  # name, architecture, num_layers, num_kv_heads, head_dim, block_size, kv_bytes_per_token, ...
    hardware: dict  # device, device_name, cpus, torch_threads
    engine: dict  # the engine options measured under: max_num_batched_tokens, max_num_seqs, num_blocks
    prefill_samples: list[dict] = field(default_factory=list)  # {new, cached, seconds}
    decode_samples: list[dict] = field(default_factory=list)  # {batch, context, seconds}
    transfer_samples: list[dict] = field(default_factory=list)  # {bytes, seconds}; empty: not measured
    transfer_backend: str = ""  # "nixl", or "" when no transfer was measured
    served: dict[str, ServedOverhead] = field(default_factory=dict)  # by serving mode; empty: engine only
    version: int = VERSION

    def __post_init__(self) -> None:
        self.prefill = fit(
            PREFILL_TERMS,
            [prefill_features(s["new"], s["cached"]) for s in self.prefill_samples],
            [s["seconds"] for s in self.prefill_samples],
        )
        self.decode = fit(
            DECODE_TERMS,
            [decode_features(s["batch"], s["context"]) for s in self.decode_samples],
            [s["seconds"] for s in self.decode_samples],
        )
        self.transfer = (
            fit(
                TRANSFER_TERMS,
                [transfer_features(s["bytes"]) for s in self.transfer_samples],
                [s["seconds"] for s in self.transfer_samples],
            )
            if self.transfer_samples
            else None
        )

    # Predictions -----------------------------------------------------------------------------------

    def prefill_s(self, new: int, cached: int = 0) -> float:
        return self.prefill.value(prefill_features(new, cached))

    def decode_step_s(self, batch: int, context: float) -> float:
        return self.decode.value(decode_features(batch, context))

    def transfer_s(self, tokens: int) -> float:
        """Moving the KV of ``tokens`` prompt tokens from a prefill worker to a decode worker (whole
        blocks, as the engine sends them); 0 when the profile measured no transfer."""
        if self.transfer is None:
            return 0.0
        bs = self.model["block_size"]
        nbytes = -(-tokens // bs) * bs * self.model["kv_bytes_per_token"]
        return self.transfer.value(transfer_features(nbytes))

    def fit_warnings(self, limit: float = NOISY_FIT) -> list[str]:
        """The compute curves whose samples stray from their fit by more than ``limit`` on average:
        a step's cost is nearly linear in its terms, so such a profile was measured while something
        else ran (the validation run of 2026-11-28: 2-thread prefill 32% mean, 69% max, 128 fresh
        tokens timed at 158 ms and 256 at 76; re-measured on a quiet machine, 1.8%)."""
        return [
            f"the {name} curve fits its samples only to {curve.mean_rel_error:.0%} on average "
            f"(worst {curve.max_rel_error:.0%}): measured while something else ran? profile again "
            "with the machine otherwise idle"
            for name, curve in (("prefill", self.prefill), ("decode", self.decode))
            if curve.mean_rel_error > limit
        ]

    # The model it belongs to -----------------------------------------------------------------------

    def check_model(self, identity: dict) -> None:
        """Refuse to plan ``identity``'s model with this profile when their shapes differ."""
        keys = ("architecture", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "kv_bytes_per_token")
        differ = [
            f"{k}: profile {self.model.get(k)!r}, model {identity.get(k)!r}"
            for k in keys
            if k in identity and self.model.get(k) != identity.get(k)
        ]
        if differ:
            raise ProfileError(
                f"the profile is of {self.model.get('name')!r}, another model than this one ("
                + "; ".join(differ)
                + "): run pdserve profile on this model"
            )

    # JSON ------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        out = {
            k: v
            for k, v in asdict(self).items()
            if k in ("version", "model", "hardware", "engine", "transfer_backend")
        }
        out["prefill"] = {"samples": self.prefill_samples, "fit": _curve_json(self.prefill)}
        out["decode"] = {"samples": self.decode_samples, "fit": _curve_json(self.decode)}
        out["transfer"] = (
            {"samples": self.transfer_samples, "fit": _curve_json(self.transfer)} if self.transfer else None
        )
        out["served"] = {mode: o.to_json() for mode, o in self.served.items()}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data) -> ModelProfile:
        """A profile from parsed JSON; ProfileError naming the first field that is wrong. The fits
        are recomputed from the samples (a hand-edited fit cannot disagree with its data)."""
        if not isinstance(data, dict):
            raise ProfileError("a profile is a JSON object")
        if data.get("version") != VERSION:
            raise ProfileError(
                f"profile version {data.get('version')!r}; this pdserve reads version {VERSION}"
            )
        for key in ("model", "hardware", "engine"):
            if not isinstance(data.get(key), dict):
                raise ProfileError(f"profile field {key!r} must be an object")
        for key in ("block_size", "kv_bytes_per_token"):
            if not _positive(data["model"].get(key)):
                raise ProfileError(f"profile field model.{key} must be a positive number")
        transfer = data.get("transfer")
        served = data.get("served") or {}
        if not isinstance(served, dict) or set(served) - set(SERVED_MODES):
            raise ProfileError(f"profile field served must map serving modes ({', '.join(SERVED_MODES)})")
        return cls(
            model=data["model"],
            hardware=data["hardware"],
            engine=data["engine"],
            prefill_samples=_samples(data.get("prefill"), "prefill", ("new", "cached", "seconds")),
            decode_samples=_samples(data.get("decode"), "decode", ("batch", "context", "seconds")),
            transfer_samples=_samples(transfer, "transfer", ("bytes", "seconds")) if transfer else [],
            transfer_backend=str(data.get("transfer_backend", "")),
            served={m: ServedOverhead.from_json(o, f"served.{m}") for m, o in served.items()},
        )

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read the profile {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ProfileError(f"the profile {path} is not JSON: {exc}") from None
        return cls.from_json(data)


def _curve_json(curve: Curve) -> dict:
    return {
        **dict(zip(curve.terms, curve.coef, strict=True)),
        "max_rel_error": curve.max_rel_error,
        "mean_rel_error": curve.mean_rel_error,
    }


def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _samples(section, name: str, keys: tuple[str, ...]) -> list[dict]:
    if not isinstance(section, dict) or not isinstance(section.get("samples"), list):
        raise ProfileError(f"profile field {name}.samples must be a list")
    out = []
    for i, s in enumerate(section["samples"]):
        if not isinstance(s, dict):
            raise ProfileError(f"{name}.samples[{i}] must be an object")
        for k in keys:
            v = s.get(k)
            ok = _positive(v) if k != "cached" else isinstance(v, int | float) and v >= 0
            if not ok:
                raise ProfileError(f"{name}.samples[{i}].{k} must be a positive number, got {v!r}")
        out.append({k: s[k] for k in keys})
    return out
