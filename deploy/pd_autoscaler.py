"""Scaling prefill and decode apart, each on its own signal, coordinated so the P:D ratio stays sane.

Prefill is compute-bound: its backlog is the prompt tokens waiting to be computed (queued in the
engines plus in flight from the router); it scales up when the backlog per replica stays above its
target, which is what TTFT grows with. Decode is memory-bound: it scales on KV-cache usage and on
running requests per replica. Each decision is a desired count from the signal, then:
- hysteresis: scale up only above ``target * (1 + tolerance)``, down only below
  ``target * (1 - tolerance)``; between the two the count stays;
- persistence: a direction must hold for ``upscale_delay_s`` / ``downscale_delay_s`` of consecutive
  evaluations before it acts (one spike does not add a replica, one lull does not remove one);
- cooldown: after a change, the pool waits ``cooldown_s`` before the next one;
- bounds per pool, and a P:D ratio kept in [min_pd_ratio, max_pd_ratio] by raising the lagging pool
  (never by refusing needed capacity to the other). An idle service (no prompt pending, no decode
  request) with ``prefill.min_replicas`` 0 may drop prefill below the ratio, to zero: the decode
  workers then prefill the first prompts themselves, and the ratio raises prefill again at once.
The policy is a pure function of (signals, time, state); ``AutoscalerLoop`` applies it to a running
application through Serve's external-scaling API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PoolScaling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="fewest replicas the policy sets")
    max_replicas: int = Field(4, ge=1, description="most replicas the policy sets, the P:D ratio included")
    upscale_delay_s: float = Field(
        15.0, ge=0, description="seconds a scale-up must be wanted at every evaluation before it is made"
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="seconds a scale-down must be wanted at every evaluation before it is made"
    )
    cooldown_s: float = Field(60.0, ge=0, description="seconds after a change of this pool before the next")

    @model_validator(mode="after")
    def _bounds(self) -> PoolScaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class PDAutoscalingConfig(BaseModel):
    """The P/D policy's knobs (``autoscaling`` in the application config)."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(5.0, gt=0, description="seconds between evaluations of the policy")
    tolerance: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="hysteresis: a pool grows only when its load asks for more than replicas x (1 + "
        "tolerance), shrinks only below replicas x (1 - tolerance)",
    )
    prefill: PoolScaling = Field(
        default_factory=PoolScaling, description="the prefill pool's bounds and delays"
    )
    decode: PoolScaling = Field(
        default_factory=PoolScaling, description="the decode pool's bounds and delays"
    )
    target_pending_prompt_tokens: int = Field(
        8192,
        ge=1,
        description="prompt tokens waiting per prefill replica (queued in the engines plus in flight from "
        "the router) that prefill scales toward",
    )
    target_kv_usage: float = Field(
        0.7, gt=0, le=1, description="mean KV-cache usage per decode replica that decode scales toward"
    )
    target_running_requests: int = Field(
        64,
        ge=1,
        description="running plus waiting requests per decode replica that decode scales toward (decode "
        "takes the larger of this and the KV-usage count)",
    )
    min_pd_ratio: float = Field(
        0.1,
        gt=0,
        description="fewest prefill replicas per decode replica; below it prefill is raised (up to its "
        "`max_replicas`), except that an idle service with `prefill.min_replicas` 0 drops prefill to 0",
    )
    max_pd_ratio: float = Field(
        4.0,
        gt=0,
        description="most prefill replicas per decode replica; above it decode is raised (up to its "
        "`max_replicas`)",
    )

    @model_validator(mode="after")
    def _ratio(self) -> PDAutoscalingConfig:
        if self.min_pd_ratio > self.max_pd_ratio:
            raise ValueError(f"min_pd_ratio {self.min_pd_ratio} > max_pd_ratio {self.max_pd_ratio}")
        if self.decode.min_replicas < 1:  # Serve's decode deployment cannot go to zero replicas
            raise ValueError("decode.min_replicas must be at least 1: a decode replica serves every request")
        return self


@dataclass(frozen=True, slots=True)
class ClusterSignals:
    """What the policy reads, summed over each pool's live workers."""

    prefill_replicas: int
    decode_replicas: int
    pending_prompt_tokens: int  # prefill engines' queues + the router's in-flight prefill work
    decode_kv_usage: float  # mean over decode workers, in [0, 1]
    decode_running: int  # running + waiting requests on decode workers


@dataclass(slots=True)
class _PoolState:
    direction: int = 0  # +1 / -1 while a change is wanted, 0 otherwise
    since: float = 0.0  # when the current direction started
    last_change: float = -math.inf


@dataclass(slots=True)
class PDAutoscaler:
    config: PDAutoscalingConfig
    prefill: _PoolState = field(default_factory=_PoolState)
    decode: _PoolState = field(default_factory=_PoolState)

    def decide(self, s: ClusterSignals, now: float) -> tuple[int, int]:
        """The (prefill, decode) replica counts to run now."""
        c = self.config
        p_want = self._desired(
            s.prefill_replicas, s.pending_prompt_tokens / c.target_pending_prompt_tokens, c.prefill
        )
        # KV usage is a mean per replica; running requests are a total over the pool.
        d_needed = max(
            s.decode_kv_usage / c.target_kv_usage * max(s.decode_replicas, 1),
            s.decode_running / c.target_running_requests,
        )
        d_want = self._desired(s.decode_replicas, d_needed, c.decode)
        p = self._gate(self.prefill, s.prefill_replicas, p_want, c.prefill, now)
        d = self._gate(self.decode, s.decode_replicas, d_want, c.decode, now)
        idle = s.pending_prompt_tokens == 0 and s.decode_running == 0
        p, d = self._ratio(p, d, prefill_floor=not (idle and c.prefill.min_replicas == 0))
        if p != s.prefill_replicas:
            self.prefill.last_change, self.prefill.direction = now, 0
        if d != s.decode_replicas:
            self.decode.last_change, self.decode.direction = now, 0
        return p, d

    def _desired(self, current: int, needed: float, pool: PoolScaling) -> int:
        """Replicas the load asks for, with hysteresis around the current count."""
        tol = self.config.tolerance
        want = current
        if needed > current * (1 + tol) or (current == 0 and needed > 0):
            want = math.ceil(needed)
        elif needed < current * (1 - tol):
            want = min(current, math.ceil(needed))  # at most the target load per replica afterwards
        return max(pool.min_replicas, min(pool.max_replicas, want))

    def _gate(self, st: _PoolState, current: int, want: int, pool: PoolScaling, now: float) -> int:
        """Apply persistence and cooldown to a wanted change."""
        direction = (want > current) - (want < current)
        if direction != st.direction:
            st.direction, st.since = direction, now
        if direction == 0:
            return current
        delay = pool.upscale_delay_s if direction > 0 else pool.downscale_delay_s
        if now - st.since < delay or now - st.last_change < pool.cooldown_s:
            return current
        return want

    def _ratio(self, p: int, d: int, prefill_floor: bool = True) -> tuple[int, int]:
        """Keep P/D within bounds by raising the lagging pool, within its own max (prefill only with
        ``prefill_floor``)."""
        c = self.config
        if prefill_floor and d > 0 and p < c.min_pd_ratio * d:
            p = min(c.prefill.max_replicas, math.ceil(c.min_pd_ratio * d))
        if p > c.max_pd_ratio * max(d, 1):
            d = min(c.decode.max_replicas, math.ceil(p / c.max_pd_ratio))
        return p, d
