"""``pdserve scale`` refuses a scale-up the cluster has no room for (Serve would leave the new
replicas pending, unscheduled, without a word), saying what is missing and what to do. The logic
around Ray's numbers; ``tests/deploy/test_scale.py`` scales a real service."""

from __future__ import annotations

import pytest

import deploy.scaling as scaling


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setattr(scaling, "target_replicas", lambda app: {"Prefill": 1, "Decode": 1, "Router": 1})
    per = {"Prefill": {"CPU": 1.0}, "Decode": {"CPU": 1.0, "GPU": 0.5}, "Router": {"CPU": 0.1}}
    monkeypatch.setattr(scaling, "replica_resources", lambda app: per)


def test_a_scale_up_without_room_is_refused_with_the_reason_and_the_fix(service):
    with pytest.raises(ValueError) as exc:  # the default local cluster of the report: 0.8 CPU free
        scaling.check_room("pdserve", {"prefill": 2}, {"CPU": 0.8})
    message = str(exc.value)
    assert "Prefill: 1 -> 2" in message and "1 CPU (free: 0.8)" in message and "--ray-cpus" in message


def test_room_is_counted_across_pools_and_per_resource(service):
    scaling.check_room("pdserve", {"prefill": 2, "decode": 2}, {"CPU": 2.0, "GPU": 1.0})  # fits exactly
    with pytest.raises(ValueError, match=r"Decode: 1 -> 2 .*1 CPU \(free: 0\)"):
        scaling.check_room("pdserve", {"prefill": 3, "decode": 2}, {"CPU": 2.0, "GPU": 1.0})
    with pytest.raises(ValueError, match="GPU"):
        scaling.check_room("pdserve", {"decode": 3}, {"CPU": 4.0, "GPU": 0.5})


def test_scaling_down_or_staying_needs_no_room(service):
    scaling.check_room("pdserve", {"prefill": 0, "decode": 1}, {})


def test_status_says_which_replicas_wait_and_whether_they_can_ever_be_placed():
    per = {"Prefill": {"CPU": 1.0}, "Decode": {"CPU": 1.0}, "Router": {"CPU": 0.1}}
    line = scaling.describe_replicas(
        {"Decode": (1, 1), "Prefill": (1, 3), "Router": (1, 1)}, per, {"CPU": 0.8}
    )
    assert "Prefill 1/3 (2 pending, unschedulable: they need 2 CPU (free: 0.8))" in line
    assert "Decode 1/1," in line and "--ray-cpus" in line
    line = scaling.describe_replicas({"Prefill": (1, 2)}, per, {"CPU": 4.0})  # room: merely starting
    assert line == "replicas running/target: Prefill 1/2 (1 starting)"
