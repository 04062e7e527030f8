"""The P/D autoscaling policy: each pool on its own signal, with bounds, hysteresis, persistence,
cooldowns and the P:D ratio."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deploy.pd_autoscaler import ClusterSignals, PDAutoscaler, PDAutoscalingConfig

CONFIG = dict(
    target_pending_prompt_tokens=1000,
    target_kv_usage=0.5,
    target_running_requests=10,
    prefill={
        "min_replicas": 1,
        "max_replicas": 4,
        "upscale_delay_s": 10,
        "downscale_delay_s": 30,
        "cooldown_s": 20,
    },
    decode={
        "min_replicas": 1,
        "max_replicas": 6,
        "upscale_delay_s": 10,
        "downscale_delay_s": 30,
        "cooldown_s": 20,
    },
    min_pd_ratio=0.25,
    max_pd_ratio=2.0,
)


def sig(p=1, d=1, pending=0, kv=0.0, running=0):
    return ClusterSignals(p, d, pending, kv, running)


def run(policy, signals, t0, t1, step=1.0):
    """Evaluate every ``step`` seconds over [t0, t1); return the decisions."""
    out, t = [], t0
    while t < t1:
        out.append(policy.decide(signals, t))
        t += step
    return out


def test_prefill_scales_on_backlog_only_after_the_upscale_delay():
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    busy = sig(p=1, d=2, pending=3500)
    decisions = run(pol, busy, 0, 10)
    assert all(d == (1, 2) for d in decisions)  # the backlog has not persisted long enough
    assert pol.decide(busy, 10) == (4, 2)  # ceil(3500 / 1000) = 4 prefill replicas


def test_a_short_spike_does_not_scale():
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    run(pol, sig(pending=5000), 0, 5)
    assert run(pol, sig(pending=0), 5, 40) == [(1, 1)] * 35  # the direction reset; min bound holds


def test_hysteresis_band_keeps_the_count():
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    # Each pool at 1.15x or 0.85x its target load: inside the 20% band, nothing moves.
    assert set(run(pol, sig(p=2, d=2, pending=2300, running=23), 0, 60)) == {(2, 2)}
    assert set(run(pol, sig(p=2, d=2, pending=1700, running=17), 60, 200)) == {(2, 2)}


def test_decode_scales_on_kv_usage_or_running_requests_and_down_after_delay_and_cooldown():
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    assert run(pol, sig(p=1, d=2, kv=0.9), 0, 11)[-1] == (1, 4)  # 0.9 / 0.5 * 2 = 3.6 -> 4
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    assert run(pol, sig(p=2, d=2, running=55), 0, 11)[-1] == (2, 6)  # 55 / 10 -> 6 (the max)
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    pol.decide(sig(p=2, d=4), 0)
    decisions = run(pol, sig(p=2, d=4, kv=0.2, running=3), 0, 31)
    # Both pools waited the downscale delay: decode to ceil(0.2 / 0.5 * 4) = 2, idle prefill to 1.
    assert decisions[-2] == (2, 4) and decisions[-1] == (1, 2)
    # Right after a change, the cooldown holds even a sustained opposite signal.
    assert set(run(pol, sig(p=1, d=2, kv=0.95), 31, 50)) == {(1, 2)}
    assert pol.decide(sig(p=1, d=2, kv=0.95), 50) == (1, 4)


def test_ratio_raises_the_lagging_pool():
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    # Decode grows to 6: prefill must follow to 6 * 0.25 = 1.5 -> 2 even with no backlog.
    assert run(pol, sig(p=1, d=2, running=60), 0, 11)[-1] == (2, 6)
    pol = PDAutoscaler(PDAutoscalingConfig(**CONFIG))
    # Prefill grows to 4 with 1 decode: 4 / 2.0 -> decode rises to 2.
    assert run(pol, sig(p=1, d=1, pending=9000), 0, 11)[-1] == (4, 2)


def test_config_validation():
    with pytest.raises(ValidationError):
        PDAutoscalingConfig(prefill={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValidationError):
        PDAutoscalingConfig(min_pd_ratio=3, max_pd_ratio=1)
    with pytest.raises(ValidationError):
        PDAutoscalingConfig(target_kv_usage=1.5)


def test_the_policy_with_serve_autoscaling_on_a_front_end_is_refused():
    """Serve refuses every replica count set from outside while any deployment autoscales itself:
    the policy would only log warnings, so the config says so at once."""
    from deploy.config import PDServeConfig

    serve_autoscaling = {"min_replicas": 1, "max_replicas": 2}
    assert PDServeConfig(model="m", autoscaling={}).external_scaler_enabled
    for pool in ("router", "ingress"):
        with pytest.raises(ValidationError, match="Serve refuses"):
            PDServeConfig(model="m", autoscaling={}, **{pool: {"autoscaling": serve_autoscaling}})


def test_an_idle_service_drops_prefill_to_a_minimum_of_zero_and_load_brings_it_back():
    """``prefill.min_replicas: 0`` is reachable: idle, prefill drops to 0 after its downscale delay
    (the ratio does not hold it up); the first decode request raises it again at once. With a
    minimum of 1 the ratio still holds prefill up while idle."""
    pool = {"min_replicas": 0, "max_replicas": 4, "downscale_delay_s": 30, "cooldown_s": 0}
    config = {
        **CONFIG,
        "prefill": pool,
        "decode": {**CONFIG["decode"], "min_replicas": 4},
        "min_pd_ratio": 0.5,
    }
    pol = PDAutoscaler(PDAutoscalingConfig(**config))
    idle = sig(p=2, d=4)
    assert run(pol, idle, 0, 30) == [(2, 4)] * 30  # the downscale delay holds
    assert pol.decide(idle, 30) == (0, 4), "an idle service never reached prefill.min_replicas 0"
    assert pol.decide(sig(p=0, d=4), 31) == (0, 4)
    assert pol.decide(sig(p=0, d=4, running=3), 32) == (2, 4)  # ceil(0.5 x 4), without delay
    held = PDAutoscaler(PDAutoscalingConfig(**{**config, "prefill": {**pool, "min_replicas": 1}}))
    assert run(held, idle, 0, 100)[-1] == (2, 4)  # the ratio's floor, above min_replicas 1
