"""``pdserve plan``: traffic descriptions and traces checked field by field, the search's answer (the
fewest workers meeting the SLOs, none smaller did), impossible SLOs refused, what-if scaling, and a
profile of another model refused at the command line."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml
from synthetic import synthetic_profile

from cli.main import main as pdserve
from planner.plan import PlanError, check_feasible, evaluate, plan
from planner.traffic import Traffic, TrafficError, load_traffic, parse_traffic

TRAFFIC = {
    "rate": 20.0,
    "requests": 200,
    "prompt_tokens": {"mean": 512, "spread": 0.5},
    "output_tokens": 16,
    "prefix": {"groups": 4, "tokens": 128},
    "slo": {"ttft_p90_s": 0.5, "itl_p50_s": 0.05},
}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(colour="red"), "unknown traffic field"),
        (lambda d: d.update(rate=0), "rate must be a positive number"),
        (lambda d: d.pop("requests"), "give requests .* or duration_s"),
        (
            lambda d: d.update(prompt_tokens={"mean": 100, "spread": 1.5}),
            r"prompt_tokens.spread must be in \[0, 1\)",
        ),
        (lambda d: d.update(output_tokens=-3), "output_tokens must be a positive integer"),
        (
            lambda d: d.update(prefix={"groups": 2, "tokens": 400}),
            "must not be longer than the shortest prompt",
        ),
        (lambda d: d.update(slo={"ttft_p99_s": 1}), "slo takes ttft_p90_s and itl_p50_s"),
        (lambda d: d.update(slo={"ttft_p90_s": -1}), "slo.ttft_p90_s must be a positive number"),
    ],
)
def test_a_malformed_traffic_description_names_its_field(edit, message):
    data = json.loads(json.dumps(TRAFFIC))
    edit(data)
    with pytest.raises(TrafficError, match=message):
        parse_traffic(data)


def test_the_traffic_description_in_the_operations_guide_is_valid(tmp_path):
    """The example a user copies from docs/operations.md loads as written (its prefix is exactly as
    long as its shortest prompt)."""
    guide = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    (example,) = re.findall(r"cat > traffic.yaml <<'YAML'\n(.*?)\nYAML\n", guide, re.S)
    (tmp_path / "traffic.yaml").write_text(example)
    traffic = load_traffic(tmp_path / "traffic.yaml")
    assert (traffic.prefix_groups, traffic.prefix_tokens) == (8, 512)
    assert all(len(r.prompt) > 512 for r in traffic.generate())


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5}', "not json"], "line 2 is not JSON"),
        (
            [
                '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 5}',
                '{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 5}',
            ],
            "arrivals must not go back",
        ),
        (
            ['{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 5}'],
            "prompt_tokens must be a positive integer",
        ),
        (['{"arrival_s": 0, "output_tokens": 5}'], "prompt_tokens must be a positive integer"),
        ([], "has no requests"),
    ],
)
def test_a_malformed_trace_names_its_line(tmp_path, lines, message):
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "traffic.yaml").write_text(yaml.safe_dump({"trace": "t.jsonl"}))
    with pytest.raises(TrafficError, match=message):
        load_traffic(tmp_path / "traffic.yaml")


def test_a_trace_replays_its_requests_and_shares_its_prefix_groups(tmp_path):
    rows = [
        {
            "arrival_s": 0.5 * i,
            "prompt_tokens": 300,
            "output_tokens": 4 + i,
            "prefix_group": i % 2,
            "prefix_tokens": 200,
        }
        for i in range(6)
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "traffic.yaml").write_text(yaml.safe_dump({"trace": "t.jsonl", "slo": {"ttft_p90_s": 1}}))
    reqs = load_traffic(tmp_path / "traffic.yaml").generate()
    assert [r.arrival for r in reqs] == [0.5 * i for i in range(6)]
    assert [r.output_len for r in reqs] == [4 + i for i in range(6)] and {len(r.prompt) for r in reqs} == {
        300
    }
    assert reqs[0].prompt[:200] == reqs[2].prompt[:200] != reqs[1].prompt[:200]


def test_generated_traffic_is_the_same_for_the_same_seed_and_shares_prefixes():
    t = parse_traffic(TRAFFIC)
    a, b = t.generate(), t.generate()
    assert [r.prompt for r in a] == [r.prompt for r in b] and len(a) == 200
    heads = {tuple(r.prompt[:128]) for r in a}
    assert len(heads) == 4  # every prompt opens with one of the 4 shared prefixes
    assert all(256 <= len(r.prompt) <= 768 for r in a)


def test_a_stored_description_reads_back_as_the_same_traffic(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"arrival_s": 0, "prompt_tokens": 9, "output_tokens": 2}\n')
    for t in (parse_traffic(TRAFFIC), load_traffic(_trace_file(tmp_path))):
        back = Traffic.from_dict(json.loads(json.dumps(asdict(t))))
        assert back == t and [r.prompt for r in back.generate()] == [r.prompt for r in t.generate()]


def _trace_file(tmp_path):
    (tmp_path / "traced.yaml").write_text("trace: t.jsonl\nslo: {ttft_p90_s: 1.0}\n")
    return tmp_path / "traced.yaml"


def test_the_plan_is_the_fewest_workers_that_meet_the_slos():
    profile, traffic = synthetic_profile(), parse_traffic(TRAFFIC)
    best, seen = plan(profile, traffic, max_workers=6)
    assert best.meets
    s = best.summary
    assert s.ttft_p90 <= 0.5 and s.itl_p50 <= 0.05
    fewer = [c for c in seen if c.workers < best.workers]
    assert fewer and not any(c.meets for c in fewer)  # smaller layouts were tried and fell short
    # What if twice the traffic: never fewer workers.
    double, _ = plan(profile, traffic.scaled(rate=2.0), max_workers=8)
    assert double.workers >= best.workers


def test_an_slo_no_hardware_could_meet_is_refused_before_searching():
    profile = synthetic_profile()
    with pytest.raises(PlanError, match="impossible TTFT SLO: a lone 512-token prompt takes"):
        plan(profile, parse_traffic({**TRAFFIC, "slo": {"ttft_p90_s": 0.01}}))
    with pytest.raises(PlanError, match="impossible ITL SLO"):
        plan(profile, parse_traffic({**TRAFFIC, "slo": {"itl_p50_s": 0.001}}))


def test_requests_longer_than_the_models_context_are_refused_before_searching():
    """The server answers them 400: a plan for them recommended a layout for traffic nobody serves."""
    profile = synthetic_profile()
    profile.model["max_model_len"] = 4096
    long = parse_traffic({**TRAFFIC, "prompt_tokens": 8000, "prefix": {"groups": 0, "tokens": 0}})
    with pytest.raises(
        PlanError,
        match="longest request needs 8000 prompt \\+ 16 output tokens, above the profiled model's context of 4096",
    ):
        plan(profile, long)
    check_feasible(profile, parse_traffic(TRAFFIC))  # at most 768 + 16 tokens: they fit


def test_one_request_of_traffic_can_be_planned():
    """A single arrival has no span: its offered rate was infinite, so no layout ever kept up."""
    best, _ = plan(synthetic_profile(), parse_traffic({**TRAFFIC, "requests": 1}), max_workers=2)
    assert best.meets and best.workers == 1


def test_traffic_beyond_the_largest_layout_is_an_error_saying_how_close_it_came():
    with pytest.raises(
        PlanError, match=r"no layout of up to 2 workers meets the traffic: the best, .* reached"
    ):
        plan(synthetic_profile(), parse_traffic({**TRAFFIC, "rate": 500.0}), max_workers=2)


def test_the_command_refuses_a_profile_of_another_model(tmp_path, tiny_llama, capsys):
    profile = synthetic_profile()
    profile.model.update(architecture="LlamaForCausalLM", num_layers=99)
    profile.save(tmp_path / "p.json")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(TRAFFIC))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--traffic", str(tmp_path / "t.yaml")]
    assert pdserve([*args, "--model", str(tiny_llama)]) == 2
    assert "another model than this one (num_layers: profile 99" in capsys.readouterr().err
    assert pdserve([*args, "--json", "--max-workers", "6"]) == 0  # without --model: planned
    out = json.loads(capsys.readouterr().out)
    assert out["decode"] >= 1 and out["predicted"]["ttft_p90"] <= 0.5


def test_workers_sharing_one_core_cannot_serve_what_workers_with_a_device_each_can(tmp_path, capsys):
    """Planned for one shared core, the same layout is slower and no layout keeps up (more workers add
    no cores); the command passes --shared-cores through and refuses 0."""
    profile = synthetic_profile()
    profile.hardware.update(torch_threads=1)
    traffic = parse_traffic(TRAFFIC)
    own, _ = plan(profile, traffic, max_workers=6)
    shared = evaluate(profile, traffic, replace(own.deployment, host_cores=1))
    assert shared.summary.ttft_p90 > 1.5 * own.summary.ttft_p90 and not shared.meets
    with pytest.raises(PlanError, match="no layout of up to 6 workers meets the traffic"):
        plan(profile, traffic, max_workers=6, host_cores=1)
    profile.save(tmp_path / "p.json")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(TRAFFIC))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--traffic", str(tmp_path / "t.yaml")]
    assert pdserve([*args, "--shared-cores", "0"]) == 2
    assert "--shared-cores must be at least 1" in capsys.readouterr().err
    assert pdserve([*args, "--max-workers", "3", "--shared-cores", "1"]) == 2
    assert "no layout of up to 3 workers meets the traffic" in capsys.readouterr().err


def test_a_profile_measured_while_something_else_ran_is_flagged(tmp_path, capsys):
    """A step's cost is nearly linear in its terms: samples far off their fit (the validation run's
    2-thread prefill, timed while the machine was busy) say the profile is suspect; plan warns."""
    clean = synthetic_profile()
    assert clean.fit_warnings() == []
    samples = [dict(s) for s in clean.prefill_samples]
    for s, factor in zip(samples, (1.0, 2.1, 0.5, 1.0, 1.9, 0.6), strict=True):  # timed beside other work
        s["seconds"] *= factor
    noisy = replace(clean, prefill_samples=samples)
    [warning] = noisy.fit_warnings()
    assert warning.startswith("the prefill curve fits its samples only to") and "profile again" in warning
    noisy.save(tmp_path / "p.json")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(TRAFFIC))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--traffic", str(tmp_path / "t.yaml")]
    pdserve([*args, "--max-workers", "2"])  # planned or not, the warning comes first
    assert f"warning: {tmp_path / 'p.json'}: the prefill curve fits" in capsys.readouterr().err


def test_keeping_up_does_not_depend_on_how_long_the_traffic_runs(capsys, tmp_path):
    """Long answers (a request's latency ~6% of the whole traffic): a layout that serves every request
    within its SLOs keeps up, as it does when the same traffic runs 12 times longer, while one worker
    (falling behind) keeps up with neither; the command prints the arrivals' rate it planned for."""
    from planner.simulator import Deployment

    profile = synthetic_profile()
    short = {"rate": 1, "requests": 50, "prompt_tokens": 256, "output_tokens": 1024}
    short["slo"] = {"ttft_p90_s": 1.0, "itl_p50_s": 0.05}
    for requests in (50, 600):
        traffic = parse_traffic({**short, "requests": requests})
        served = evaluate(profile, traffic, Deployment(0, 8))
        s = served.summary
        assert s.ttft_p90 < 0.1 and s.itl_p50 < 0.01  # far within the SLOs, no queue
        assert served.meets, f"{requests} requests within SLOs on 8 workers do not keep up: {s}"
        assert not evaluate(profile, traffic, Deployment(0, 1)).meets
    traffic = parse_traffic(short)
    best, _ = plan(profile, traffic, max_workers=8)
    assert best.workers == 2
    profile.save(tmp_path / "p.json")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(short))
    assert (
        pdserve(["plan", "--profile", str(tmp_path / "p.json"), "--traffic", str(tmp_path / "t.yaml")]) == 0
    )
    assert f"workers) for {best.arriving:.2f} req/s" in capsys.readouterr().out  # the rate it planned for
