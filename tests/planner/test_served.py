"""The served path in the planner: the overhead fit, the simulator adding it (and shared cores) to
the engine's curves, the profile file carrying it, and ``pdserve profile --served`` measuring a real
streaming HTTP server (``bench.minimal_server``, a child process on the tiny model)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from synthetic import synthetic_profile

from bench.minimal_server import minimal_serving
from bench.ports import free_port
from cli.main import main as pdserve
from planner import host_cpu
from planner.costs import ModelProfile, ProfileError, ServedOverhead
from planner.served import Client, ServedError, fit_overhead, fit_warning, measure_served
from planner.simulator import FRONT_WINDOW_S, Deployment, SimRequest, Simulator


def prompt(tenant: int, length: int) -> list[int]:
    return [(tenant * 1000 + i) % 30000 + 10 for i in range(length)]


def test_the_overhead_fit_recovers_the_costs_added_to_the_engine():
    samples = [
        {"kind": "ttft", "prompt": n, "seconds": e + 0.012, "engine_s": e}
        for n, e in ((32, 0.01), (256, 0.05))
    ]
    samples += [
        {"kind": "itl", "batch": b, "prompt": 32, "seconds": e + 0.002 + 0.0004 * b, "engine_s": e}
        for b, e in ((1, 0.005), (2, 0.006), (4, 0.008), (8, 0.012))
    ]
    over = fit_overhead(samples)
    assert over.ttft_s == pytest.approx(0.012)
    assert (over.step_s, over.step_per_seq_s) == pytest.approx((0.002, 0.0004))
    # A lone stream no slower than the engine's step (its streaming hidden), a batch slower: the
    # overhead is per sequence, never negative.
    for s, extra in zip(samples[2:], (-0.0003, 0.0, 0.0031, 0.0054), strict=True):
        s["seconds"] = s["engine_s"] + extra
    over = fit_overhead(samples)
    assert over.step_s >= 0 and over.step_per_seq_s == pytest.approx(0.0553 / 85)  # through the origin
    with pytest.raises(ServedError, match="needs TTFT and ITL samples"):
        fit_overhead(samples[:2])
    # The front end's CPU over a phase of 2 tokens per request and one of 24: per request and per token.
    cpu = [
        {"kind": "cpu", "phase": phase, "requests": r, "tokens": t, "seconds": 0.003 * r + 0.0005 * t}
        | {"engine_seconds": cores * busy, "engine_busy_s": busy}
        for phase, r, t, busy, cores in (("ttft", 12, 24, 0.5, 1.3), ("itl", 40, 960, 2.0, 1.6))
    ]
    over = fit_overhead(samples + cpu)
    assert (over.cpu_per_request_s, over.cpu_per_token_s) == pytest.approx((0.003, 0.0005))
    # Its torch thread and 0.3 of a core more, from the lone requests: the batches' step time is the
    # profile's guess (several decode workers may split a batch), so it is left out.
    assert over.engine_cores == pytest.approx(1.3)
    assert fit_overhead(samples + cpu[1:]).cpu_per_token_s == pytest.approx(
        0.6 / 960
    )  # one phase: all per token
    assert fit_overhead(samples).cpu_per_token_s == fit_overhead(samples).engine_cores == 0.0  # remote
    # A served prompt computed 30% slower than the engine alone, after a 4 ms hop: both recovered.
    for s, e in zip(samples[:2], (0.01, 0.05), strict=True):
        s["seconds"] = e + 0.004 + 0.3 * e
    over = fit_overhead(samples)
    assert (over.ttft_s, over.prefill_scale, over.per_token_s) == pytest.approx((0.004, 0.3, 0.0))
    # With cached repeats (long prompts, little to compute) the front end's per-token cost is told
    # apart from a slower prefill.
    ttft = [
        {"kind": "ttft", "prompt": n, "cached": c, "seconds": e + 0.004 + 0.3 * e + 2e-5 * n, "engine_s": e}
        for n, c, e in ((32, 0, 0.01), (32, 16, 0.006), (256, 0, 0.05), (256, 240, 0.012))
    ]
    over = fit_overhead(ttft + samples[2:])
    assert (over.ttft_s, over.prefill_scale, over.per_token_s) == pytest.approx((0.004, 0.3, 2e-5))
    assert over.intake_s(100) == pytest.approx(0.004 + 100 * 2e-5)


def test_the_simulator_adds_the_served_path_of_the_deployments_mode():
    over = ServedOverhead(
        ttft_s=0.02, step_s=0.001, step_per_seq_s=0.0005, prefill_scale=0.5, per_token_s=1e-5
    )
    p = replace(synthetic_profile(), served={"disaggregated": over})
    [r] = Simulator(p, Deployment(1, 1)).run([SimRequest(1.0, prompt(1, 200), 3)])
    assert r.first_token == pytest.approx(1.0 + 0.02 + 200e-5 + 1.5 * p.prefill_s(200, 0), abs=1e-12)
    t = r.first_token + p.transfer_s(200)
    expected = [r.first_token]
    for k in range(2):
        t += p.decode_step_s(1, 201 + k) + 0.001 + 0.0005
        expected.append(t)
    assert r.token_times == pytest.approx(expected, abs=1e-12)
    # An aggregated deployment takes the aggregated mode's overhead: none measured here.
    [a] = Simulator(p, Deployment(0, 1)).run([SimRequest(1.0, prompt(1, 200), 1)])
    assert a.first_token == pytest.approx(1.0 + p.prefill_s(200, 0), abs=1e-12)


def test_workers_sharing_too_few_cores_run_slower_and_enough_cores_change_nothing():
    p = replace(synthetic_profile(), hardware={"device": "cpu", "torch_threads": 1})

    def run(cores: int | None) -> list[SimRequest]:
        # The second prompt is prefilled at 0.2 s while the first one decodes: both workers busy.
        reqs = [SimRequest(0.0, prompt(1, 512), 64), SimRequest(0.2, prompt(2, 1024), 4)]
        return Simulator(p, Deployment(1, 1, host_cores=cores)).run(reqs)

    alone = run(None)
    assert alone[0].token_times[-1] > 0.3  # still decoding when the second prompt arrives
    assert alone[1].first_token == pytest.approx(0.2 + p.prefill_s(1024), abs=1e-12)
    shared = run(1)  # two busy single-thread workers on one core: each step takes twice as long
    assert shared[1].first_token == pytest.approx(0.2 + 2 * p.prefill_s(1024), abs=1e-12)
    assert [r.token_times for r in run(2)] == [r.token_times for r in alone]
    # Engine processes measured keeping 1.5 cores busy each (their threads beyond torch's): on two
    # cores the pair of busy workers wants three.
    p = replace(p, served={"disaggregated": ServedOverhead(engine_cores=1.5)})
    assert run(2)[1].first_token == pytest.approx(0.2 + 1.5 * p.prefill_s(1024), abs=1e-12)
    with pytest.raises(ValueError, match="host_cores must be at least 1"):
        Deployment(1, 1, host_cores=0)


@pytest.mark.parametrize("measured", [False, True])
def test_the_front_end_on_shared_cores_slows_the_workers_steps(measured):
    """Taking requests in and streaming tokens takes cores from the workers' steps (counted over the
    last ``FRONT_WINDOW_S``): the front end's measured CPU, or unmeasured its latency terms; a worker
    whose threads fill the cores has its own requests' share in its measured latency already."""
    cpu = {"cpu_per_request_s": 0.03, "cpu_per_token_s": 0.01} if measured else {}
    over = ServedOverhead(ttft_s=0.0 if measured else 0.03, step_per_seq_s=0.002 if measured else 0.01, **cpu)
    base = replace(synthetic_profile(), hardware={"device": "cpu", "torch_threads": 1})
    p = replace(base, served={"disaggregated": over, "aggregated": over})

    def run(cores: int | None) -> list[SimRequest]:
        reqs = [SimRequest(0.0, prompt(1, 512), 64), SimRequest(0.2, prompt(2, 1024), 4)]
        return Simulator(p, Deployment(1, 1, host_cores=cores)).run(reqs)

    alone, shared = run(None), run(2)
    intake = over.intake_s(1024)
    assert alone[1].first_token == pytest.approx(0.2 + intake + p.prefill_s(1024), abs=1e-12)
    start = 0.2 + intake  # the second prompt's step
    streamed = sum(start - FRONT_WINDOW_S <= t <= start for t in shared[0].token_times)
    assert streamed >= 2
    # Cores the front end kept busy just before it (the first request's tokens streamed then, the
    # second's intake), with the decode and the prefill worker busy too.
    load = (0.03 + streamed * 0.01) / FRONT_WINDOW_S
    expected = start + p.prefill_s(1024) * (2 + load) / 2
    assert shared[1].first_token == pytest.approx(expected, abs=1e-12)

    def one(cores: int | None) -> list[float]:
        reqs = [SimRequest(0.0, prompt(1, 512), 64)]
        return Simulator(p, Deployment(0, 1, host_cores=cores)).run(reqs)[0].token_times

    assert one(1) == one(None)  # alone on its core: its own streaming does not slow it again


def test_a_profile_keeps_its_served_overheads_and_refuses_malformed_ones(tmp_path):
    over = ServedOverhead(0.01, 0.002, 0.0003, ({"kind": "ttft", "seconds": 0.02},), 0.25, 3e-6)
    p = replace(synthetic_profile(), served={"aggregated": over})
    p.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json").served == {"aggregated": over}
    for edit, message in (
        (
            lambda d: d["served"]["aggregated"].update(step_s=-1),
            r"served.aggregated.step_s must be a number >= 0",
        ),
        (lambda d: d["served"].update(pipelined={}), "served must map serving modes"),
        (lambda d: d["served"]["aggregated"].update(samples="x"), "served.aggregated.samples must be a list"),
        (
            lambda d: d["served"]["aggregated"].update(prefill_scale="x"),
            "served.aggregated.prefill_scale must be a number >= 0",
        ),
    ):
        data = json.loads((tmp_path / "p.json").read_text())
        edit(data)
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=message):
            ModelProfile.load(tmp_path / "bad.json")
    data = json.loads((tmp_path / "p.json").read_text())
    for key in ("prefill_scale", "per_token_s"):  # a profile from before they were measured
        del data["served"]["aggregated"][key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = ModelProfile.load(tmp_path / "old.json").served["aggregated"]
    assert old == replace(over, prefill_scale=0.0, per_token_s=0.0)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with minimal_serving(str(tiny_llama)) as base:
        yield base


def _profile_of(tiny_llama) -> ModelProfile:
    config = json.loads((tiny_llama / "config.json").read_text())
    p = synthetic_profile()
    model = {
        **p.model,
        "vocab_size": config["vocab_size"],
        "max_model_len": config["max_position_embeddings"],
    }
    return replace(p, model=model)


def test_measuring_a_real_server_samples_ttft_alone_and_itl_per_batch(server, tiny_llama):
    lines = []
    over = measure_served(
        Client(server),
        _profile_of(tiny_llama),
        batches=(1, 3),
        repeats=1,
        progress=lines.append,
        host_usage=host_cpu.usage,
        busy_streams=2,
    )
    cpu = [s for s in over.samples if s["kind"] == "cpu"]
    # The server's CPU over each phase: 6 lone requests of 2 tokens, then 1 + 3 of 24 (a chunk each).
    assert [(s["phase"], s["requests"]) for s in cpu] == [("ttft", 6), ("itl", 4)]
    assert cpu[0]["tokens"] <= 12 and cpu[1]["tokens"] >= 4 * 12
    # (The reading is machine-wide: other tests' processes may run meanwhile, so no exact value.)
    assert over.cpu_per_token_s > 0 and all(s["seconds"] >= 0 for s in cpu)
    kinds = [
        (s["kind"], s.get("prompt"), s.get("cached"), s.get("batch"))
        for s in over.samples
        if s["kind"] != "cpu"
    ]
    assert kinds == [
        ("ttft", 32, 0, None),
        ("ttft", 32, 16, None),  # sent again: its whole blocks cached
        ("ttft", 128, 0, None),
        ("ttft", 128, 112, None),
        ("ttft", 256, 0, None),
        ("ttft", 256, 240, None),
        ("itl", 32, None, 1),
        ("itl", 32, None, 3),
        # The same prompts again (fresh, then cached) while 2 long requests decode.
        ("busy", 32, 0, None),
        ("busy", 32, 16, None),
        ("busy", 128, 0, None),
        ("busy", 128, 112, None),
        ("busy", 256, 0, None),
        ("busy", 256, 240, None),
    ]
    assert all(s["seconds"] > 0 for s in over.samples if s["kind"] != "cpu")  # (those: >= 0, above)
    assert min(over.ttft_s, over.step_s, over.step_per_seq_s, over.per_token_s, over.prefill_scale) >= 0
    busy = [s for s in over.samples if s["kind"] == "busy"]
    sent = [s["sent"] for s in busy]
    assert sent == sorted(sent) and sent[0] > 0  # one after another, after the long ones were sent
    assert {(s["streams"], s["stream_prompt"]) for s in busy} == {(2, 32)}
    # The long ones outlast the probes: at least 64 tokens, within the model's length.
    assert 64 <= busy[0]["stream_tokens"] <= _profile_of(tiny_llama).model["max_model_len"] - 33
    assert len(lines) == 16 and lines[0].startswith("TTFT of a 32-token prompt alone, 0 cached")
    assert lines[-1].startswith("TTFT of a 256-token prompt, 240 cached, beside 2 decoding")
    with pytest.raises(ServedError, match=r"names no model\.vocab_size"):
        measure_served(Client(server), synthetic_profile())  # nothing to draw prompt tokens below


def test_the_command_stores_the_served_path_in_the_profile(server, tiny_llama, tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile_of(tiny_llama).save(path)
    assert pdserve(["profile", "--out", str(path), "--served", server]) == 2
    assert "--served needs --served-mode" in capsys.readouterr().err
    assert pdserve(["profile", "--out", str(path), "--served", server, "--served-mode", "aggregated"]) == 0
    served = ModelProfile.load(path).served
    assert set(served) == {"aggregated"} and len(served["aggregated"].samples) == 14  # + 2 CPU phases
    assert served["aggregated"].cpu_per_token_s > 0  # a server on this machine: its CPU measured
    nobody = f"http://127.0.0.1:{free_port()}"
    assert pdserve(["profile", "--out", str(path), "--served", nobody, "--served-mode", "aggregated"]) == 1
    assert f"cannot reach {nobody}" in capsys.readouterr().err
    # Flags of the engine's measurement are refused rather than ignored.
    served = ["profile", "--out", str(path), "--served", server, "--served-mode", "aggregated"]
    assert pdserve([*served, "--quick", "--block-size", "8", "--model", "m"]) == 2
    assert "--quick, --model, --block-size do not apply with --served" in capsys.readouterr().err


def test_an_unwritable_out_fails_before_the_measurement(tmp_path, capsys, monkeypatch):
    """Checked first: a profile takes minutes on a GPU, and the results were lost to a traceback."""
    import planner.profile

    monkeypatch.setattr(planner.profile, "profile_engine", lambda *a, **k: pytest.fail("measured first"))
    assert pdserve(["profile", "--quick", "--out", str(tmp_path / "missing" / "p.json")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: --out {tmp_path / 'missing' / 'p.json'}: no directory {tmp_path / 'missing'}"
    )


def test_a_fit_of_all_zeros_warns_that_the_engine_profile_was_too_slow():
    """A deployment no slower than its engine profile anywhere: the profile's steps were timed while
    something else ran (the fit clips at zero, so it would silently plan with no served overhead)."""
    samples = [
        {"kind": "ttft", "prompt": n, "seconds": e * 0.9, "engine_s": e} for n, e in ((32, 0.01), (256, 0.05))
    ]
    samples += [
        {"kind": "itl", "batch": b, "prompt": 32, "seconds": 0.004, "engine_s": 0.005} for b in (1, 4)
    ]
    assert "profile the engine again on an idle machine" in fit_warning(fit_overhead(samples))
    samples[0]["seconds"] = 0.03  # one real overhead is enough
    assert fit_warning(fit_overhead(samples)) is None
