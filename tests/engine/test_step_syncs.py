"""A step never waits for the device while it launches: its host data crosses in the step's one
packed upload or through ``engine.device_copy`` (pinned, non-blocking). A plain ``tensor.to(cuda)``
or ``torch.tensor(data, device=cuda)`` inside ``ModelRunner.launch`` synchronizes the stream, so
the host waits for the step's own forward before it can launch the sampling (and, overlapped, before
it can prepare the next step). Requests that arrive one by one, as the served path delivers them,
put a prompt into almost every step: that is where such copies hid (the sampled rows of a step with
a prompt in it, the rows of a steady batch being captured), nearly one per step.

On CPU there is no stream to wait for, so the CPU test records every host-to-device call made
inside ``launch``; the GPU test asks PyTorch to raise on any synchronizing call there."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, EngineCore, SamplingParams
from engine.model_runner import ModelRunner

# Sampling modes, each request taking the next: greedy, seeded random with top-k/top-p/min-p,
# penalties, bias, two samples (a fork), logprobs. The last three kinds never make a step wait for
# its tokens on the host, so a workload of those alone overlaps (async scheduling) almost every step.
KINDS = [
    dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    dict(temperature=0, logit_bias={7: 2.0}),
    dict(temperature=0.8, n=2),
    dict(temperature=0),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=0, logprobs=3),
]
OVERLAPPING = KINDS[3:]


def _params(i: int, kinds: list[dict]) -> SamplingParams:
    kind = kinds[i % len(kinds)]
    seed = i if kind["temperature"] else None
    return SamplingParams(max_tokens=6 + i % 9, ignore_eos=True, seed=seed, **kind)


def _staggered(core: EngineCore, num_requests: int, seed: int, kinds: list[dict] = KINDS) -> int:
    """Feed ``core`` one request per step (the next once the last is in), the way requests reach a
    served engine, until all are done; the steps taken."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 30))] for _ in range(num_requests)]
    steps = 0
    while prompts or core.has_unfinished():
        if prompts:
            core.add_request(f"r{seed}-{len(prompts)}", prompts.pop(), _params(len(prompts), kinds))
        core.step()
        steps += 1
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return steps


@pytest.fixture
def overlapped(monkeypatch) -> list[int]:
    """Collected steps that overlapped the next launch, and how many of those had logprobs."""
    counts = [0, 0]
    collect = ModelRunner.collect

    def counting(self, step):
        if step.done is None and step.slots:  # launched ahead of this collect
            counts[0] += 1
            counts[1] += step.result is not None and step.result.sampled_logprobs is not None
        return collect(self, step)

    monkeypatch.setattr(ModelRunner, "collect", counting)
    return counts


@pytest.fixture
def host_to_device_in_launch(monkeypatch):
    """Where ``launch`` moved host data to a device: ``Tensor.to(device)``, ``torch.tensor`` /
    ``torch.as_tensor(..., device=)``, each a stream sync on a GPU (one ``non_blocking`` from
    pageable memory may be too)."""
    calls: list[str] = []
    inside = [False]
    to, tensor, as_tensor, launch = torch.Tensor.to, torch.tensor, torch.as_tensor, ModelRunner.launch

    def note(what: str) -> None:
        if inside[0]:
            calls.append(what)

    def recording_to(self, *args, **kw):
        if "device" in kw or any(isinstance(a, (torch.device, str)) for a in args):
            note(f"Tensor.to{args}")
        return to(self, *args, **kw)

    def recording_tensor(*args, **kw):
        if kw.get("device") is not None:
            note("torch.tensor")
        return tensor(*args, **kw)

    def recording_as_tensor(*args, **kw):
        if kw.get("device") is not None:
            note("torch.as_tensor")
        return as_tensor(*args, **kw)

    def recording_launch(self, *args, **kw):
        inside[0] = True
        try:
            return launch(self, *args, **kw)
        finally:
            inside[0] = False

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    monkeypatch.setattr(torch, "tensor", recording_tensor)
    monkeypatch.setattr(torch, "as_tensor", recording_as_tensor)
    monkeypatch.setattr(ModelRunner, "launch", recording_launch)
    return calls


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_step_moves_host_data_to_the_device_only_in_its_upload(
    tiny_llama, host_to_device_in_launch, overlapped, async_scheduling
):
    core = EngineCore(
        EngineConfig(
            model=str(tiny_llama), async_scheduling=async_scheduling, block_size=4, num_blocks=128,
            max_num_batched_tokens=24,
        )
    )  # fmt: skip
    steps = _staggered(core, num_requests=24, seed=5)
    assert steps > 24 and core.runner.num_forwards >= steps - 1
    steps = _staggered(core, num_requests=18, seed=6, kinds=OVERLAPPING)
    if async_scheduling == "on":  # the overlapped path ran, logprobs included
        assert overlapped[0] > steps // 2 and overlapped[1] > 5
    else:
        assert overlapped == [0, 0]
    assert host_to_device_in_launch == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (stream syncs)")
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_on_a_gpu_a_step_launches_without_waiting_for_the_device(
    tiny_llama, monkeypatch, overlapped, async_scheduling
):
    """PyTorch raises on a synchronizing call (a blocking copy, ``.item()``, ``.tolist()``) while a
    step launches, and while an overlapped step's outputs are collected after the next launch (its
    ids and logprobs come from pinned copies once its event has passed). A step that does not
    overlap reads its outputs on the device by design: its collect may sync. The engine fails a
    step's requests rather than raise from ``launch``, so the errors are recorded here."""
    launch, collect = ModelRunner.launch, ModelRunner.collect  # (collect: the counting one)
    errors: list[str] = []

    def strict(fn, mode: str):
        def run(*args, **kw):
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(mode)
            try:
                return fn(*args, **kw)
            except RuntimeError as e:
                errors.append(f"{fn.__name__}: {e}")
                raise
            finally:
                torch.cuda.set_sync_debug_mode(before)

        return run

    def checked_collect(self, step):
        mode = "error" if step.ready is not None else "default"
        return strict(collect, mode)(self, step)

    core = EngineCore(
        EngineConfig(
            model=str(tiny_llama), device="cuda", async_scheduling=async_scheduling, block_size=4,
            num_blocks=128, max_num_batched_tokens=24,
        )
    )  # fmt: skip
    monkeypatch.setattr(ModelRunner, "launch", strict(launch, "error"))
    monkeypatch.setattr(ModelRunner, "collect", checked_collect)
    assert _staggered(core, num_requests=24, seed=5) > 24
    _staggered(core, num_requests=18, seed=6, kinds=OVERLAPPING)
    assert errors == []
    if async_scheduling == "on":
        assert overlapped[0] > 0 and overlapped[1] > 0
