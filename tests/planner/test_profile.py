"""The planner's cost curves and profiles: fits that recover known costs, a profile file that round-trips
and refuses what it cannot use, and ``pdserve profile`` measuring the real engine (and a real NIXL
READ between two processes) into a file ``ModelProfile.load`` takes."""

from __future__ import annotations

import json

import pytest

from cli.main import main as pdserve
from planner.costs import (
    DECODE_TERMS,
    PREFILL_TERMS,
    ModelProfile,
    ProfileError,
    decode_features,
    fit,
    prefill_features,
)
from planner.profile import Grid


def test_a_fit_recovers_the_costs_that_made_its_samples():
    truth = (0.002, 1e-4, 2e-8)
    rows = [prefill_features(n, c) for n in (16, 128, 512, 2048) for c in (0, 256, 1024)]
    seconds = [sum(t * f for t, f in zip(truth, r, strict=True)) for r in rows]
    curve = fit(PREFILL_TERMS, rows, seconds)
    assert curve.coef == pytest.approx(truth, rel=1e-6)
    assert curve.max_rel_error < 1e-9


def test_a_term_that_would_be_negative_is_dropped_not_kept_negative():
    rows = [decode_features(b, c) for b in (1, 8, 32, 128) for c in (128, 1024, 4096)]
    # Costs that fall with context (noise, a cache effect): the context term explains nothing.
    seconds = [0.01 + 0.001 * r[1] - 1e-7 * r[2] for r in rows]
    curve = fit(DECODE_TERMS, rows, seconds)
    assert curve.coef[2] == 0.0
    # ... and the others are refitted without it, not kept from the fit that had it.
    without = fit(DECODE_TERMS[:2], [r[:2] for r in rows], seconds)
    assert curve.coef[:2] == pytest.approx(without.coef)
    assert curve.max_rel_error == pytest.approx(without.max_rel_error)


def test_too_few_samples_for_the_terms_is_an_error():
    with pytest.raises(ProfileError, match="2 samples cannot fit 3 terms"):
        fit(PREFILL_TERMS, [prefill_features(16, 0), prefill_features(32, 0)], [0.1, 0.2])


@pytest.fixture(scope="module")
def profiled(tiny_llama, tmp_path_factory):
    """``pdserve profile --quick`` on the tiny model, KV transfer over NIXL included."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    code = pdserve(
        ["profile", "--quick", "--model", str(tiny_llama), "--num-blocks", "256", "--out", str(out)]
    )
    assert code == 0
    return out


def test_profile_measures_every_grid_point_that_fits_and_names_its_model(profiled, tiny_llama):
    data = json.loads(profiled.read_text())
    grid = Grid.default(quick=True)
    config = json.loads((tiny_llama / "config.json").read_text())
    assert data["model"]["num_layers"] == config["num_hidden_layers"]
    assert data["model"]["hidden_size"] == config["hidden_size"]
    assert data["model"]["kv_bytes_per_token"] == (
        config["num_hidden_layers"]
        * 2
        * config["num_key_value_heads"]
        * (config["hidden_size"] // config["num_attention_heads"])
        * 4  # float32
    )
    prefill = [(s["new"], s["cached"]) for s in data["prefill"]["samples"]]
    assert prefill == [(16, 0), (64, 0), (32, 32), (128, 0), (64, 64)]  # 50% of 16 is no whole block
    decode = data["decode"]["samples"]
    assert sorted({s["batch"] for s in decode}) == list(grid.decode_batches) and len(decode) == 6
    block_bytes = data["model"]["kv_bytes_per_token"] * data["model"]["block_size"]
    assert [s["bytes"] for s in data["transfer"]["samples"]] == [
        n * block_bytes for n in grid.transfer_blocks
    ]
    assert data["transfer_backend"] == "nixl"
    for section in ("prefill", "decode", "transfer"):
        assert all(s["seconds"] > 0 for s in data[section]["samples"])


def test_a_profile_round_trips_and_predicts_as_it_did(profiled, tmp_path):
    first = ModelProfile.load(profiled)
    first.save(tmp_path / "again.json")
    again = ModelProfile.load(tmp_path / "again.json")
    points = [(64, 0), (512, 0), (512, 256), (2048, 1024)]
    for p in (first, again):  # costs are positive and never fall as the work grows
        assert 0 < p.prefill_s(64, 0) <= p.prefill_s(512, 0) <= p.prefill_s(512, 256)
        assert 0 < p.decode_step_s(1, 1024) <= p.decode_step_s(8, 1024) <= p.decode_step_s(8, 4096)
        assert 0 < p.transfer_s(16) <= p.transfer_s(1024)
    assert [again.prefill_s(n, c) for n, c in points] == [first.prefill_s(n, c) for n, c in points]
    assert again.decode.coef == first.decode.coef and again.transfer.coef == first.transfer.coef


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=99), "profile version 99"),
        (lambda d: d.pop("model"), "field 'model' must be an object"),
        (lambda d: d["model"].update(block_size=0), "model.block_size must be a positive number"),
        (lambda d: d["decode"]["samples"][2].update(seconds=-1), r"decode.samples\[2\].seconds"),
        (lambda d: d["prefill"].update(samples="many"), "prefill.samples must be a list"),
        (lambda d: d["decode"].update(samples=d["decode"]["samples"][:2]), "2 samples cannot fit 3 terms"),
    ],
)
def test_a_malformed_profile_is_refused_with_the_field_named(profiled, tmp_path, edit, message):
    data = json.loads(profiled.read_text())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        ModelProfile.load(path)


def test_a_file_that_is_not_json_or_not_there_is_refused(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="is not JSON"):
        ModelProfile.load(tmp_path / "x.json")
    with pytest.raises(ProfileError, match="cannot read the profile"):
        ModelProfile.load(tmp_path / "missing.json")


def test_a_profile_of_another_model_is_refused(profiled):
    profile = ModelProfile.load(profiled)
    profile.check_model(dict(profile.model))  # its own model: fine
    other = dict(profile.model, num_layers=profile.model["num_layers"] + 1)
    with pytest.raises(ProfileError, match=r"another model than this one .*num_layers"):
        profile.check_model(other)
