"""Every engine option is declared once (``EngineConfig``) and reaches every surface: the flags of
``pdserve serve``, ``pdserve generate`` and the worker entry points, the Serve config's
``EngineOptions`` (which the KubeRay values feed), with the same defaults and help text."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from cli.main import build_parser
from deploy.config import EngineOptions, PDServeConfig
from engine.args import add_engine_args, engine_config_from_args, flag_name
from engine.config import EngineConfig

OPTIONS = [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_lists_every_engine_option(command: str):
    help_text = _subparser(command).format_help()
    missing = [flag_name(f.name) for f in OPTIONS if flag_name(f.name) not in help_text]
    assert missing == [], f"pdserve {command} --help lacks {missing}"
    assert "--no-cuda-graphs" in help_text  # booleans can be switched off


def test_worker_entry_points_share_the_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "m", "--no-cuda-graphs", "--max-num-seqs", "7", "--no-prefix-caching"])
    config = engine_config_from_args(args)
    assert (config.model, config.cuda_graphs, config.max_num_seqs, config.enable_prefix_caching) == (
        "m",
        False,
        7,
        False,
    )


def test_defaults_agree_everywhere():
    args = _subparser("serve").parse_args([])
    opts = EngineOptions()
    for f in OPTIONS:
        assert getattr(args, f.name) == f.default, f.name
        assert getattr(opts, f.name) == f.default, f.name
        assert EngineOptions.model_fields[f.name].description == f.metadata["help"]


def test_serve_flags_reach_the_application_config():
    from cli.serve_args import config_from_args

    args = _subparser("serve").parse_args(["--no-cuda-graphs", "--block-size", "32", "--swap-space", "1.5"])
    config = config_from_args(args, "some/model", tiny=False)
    engine = config.engine.engine_config(config.model)
    assert (engine.cuda_graphs, engine.block_size, engine.swap_space) == (False, 32, 1.5)


def test_run_time_lora_loading_is_a_serve_flag_off_by_default():
    """The README's ``pdserve serve ... --allow-runtime-lora`` (it was an unknown flag there)."""
    from cli.serve_args import config_from_args

    parse = _subparser("serve").parse_args
    assert config_from_args(parse([]), "m", tiny=False).ingress.allow_runtime_lora is False
    assert config_from_args(parse(["--allow-runtime-lora"]), "m", tiny=False).ingress.allow_runtime_lora


def test_the_stream_interval_reaches_the_decode_pool_and_must_be_positive():
    from pydantic import ValidationError

    from cli.serve_args import config_from_args

    parse = _subparser("serve").parse_args
    assert config_from_args(parse([]), "m", tiny=False).decode.stream_interval == 1
    assert config_from_args(parse(["--stream-interval", "4"]), "m", tiny=False).decode.stream_interval == 4
    with pytest.raises(ValidationError, match="stream_interval"):
        config_from_args(parse(["--stream-interval", "0"]), "m", tiny=False)


def test_worker_replicas_run_their_engine_in_a_process_of_its_own_by_default():
    from cli.serve_args import config_from_args

    parse = _subparser("serve").parse_args
    for flags, expected in (
        ([], True),  # disaggregated: both pools (measured faster with a model that computes)
        (["--mode", "aggregated"], True),
        (["--mode", "aggregated", "--engine-process", "off"], False),
        (["--engine-process", "off"], False),
    ):
        config = config_from_args(parse(flags), "m", tiny=False)
        assert config.engine_process("decode") is expected, flags
        assert config.engine_process("prefill") is expected, flags


def test_a_local_cpu_cluster_shares_the_cores_out_among_its_workers(monkeypatch):
    """Without --cpu-threads, each CPU engine of a cluster started here gets cores / workers torch
    threads (a Ray replica would otherwise get OMP_NUM_THREADS=1 and leave cores idle); a value given,
    a GPU engine or a remote cluster keep theirs."""
    import cli.host_share
    from cli.serve_args import config_from_args

    monkeypatch.setattr(cli.host_share, "usable_cores", lambda: 8)

    def threads(*flags: str) -> int | None:
        args = _subparser("serve").parse_args(["--ray-cpus", "8", *flags])
        return config_from_args(args, "m", tiny=False).engine.cpu_threads

    assert threads() == 4  # 1 prefill + 1 decode
    assert threads("--mode", "aggregated") == 8
    assert threads("--mode", "aggregated", "--decode", "3") == 2
    assert threads("--prefill", "5", "--decode", "5") == 1
    assert threads("--cpu-threads", "3") == 3
    assert threads("--device", "cuda") is None
    assert threads("--address", "10.0.0.1:6379") is None


def test_the_cores_shared_out_are_those_this_process_may_use(monkeypatch):
    """Without --ray-cpus the cores counted are the process's own (a container's cpuset, taskset),
    not the host's: 3 usable cores of a 64-core host give an aggregated worker 3 threads, not 64."""
    import os

    from cli.serve_args import config_from_args

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9})
    args = _subparser("serve").parse_args(["--mode", "aggregated"])
    assert config_from_args(args, "m", tiny=False).engine.cpu_threads == 3
    args = _subparser("serve").parse_args([])
    assert config_from_args(args, "m", tiny=False).engine.cpu_threads == 1  # 1 prefill + 1 decode


def test_serve_config_validates_with_the_engines_own_checks():
    with pytest.raises(ValueError, match="power of two"):
        PDServeConfig(model="m", engine={"block_size": 24})
    with pytest.raises(ValueError):
        PDServeConfig(model="m", engine={"no_such_option": 1})
    assert PDServeConfig(model="m", engine={"cuda_graphs": False}).engine.cuda_graphs is False


def test_pools_override_engine_options_and_keep_the_kv_layout_shared():
    """Prefill and decode pools may run their own engine options (a smaller KV pool on prefill),
    checked like the shared ones; what their KV's layout depends on stays one value."""
    from cli.serve_args import config_from_args

    args = _subparser("serve").parse_args(
        ["--num-blocks", "900", "--prefill-engine", '{"num_blocks": 300, "max_num_seqs": 8}']
    )
    config = config_from_args(args, "some/model", tiny=False)
    prefill, decode = config.engine_for("prefill"), config.engine_for("decode")
    assert (prefill.num_blocks, prefill.max_num_seqs, decode.num_blocks) == (300, 8, 900)
    assert decode.max_num_seqs == config.engine.max_num_seqs
    with pytest.raises(ValueError, match=r"(?s)prefill\.engine.*num_blocks must be a positive"):
        PDServeConfig(model="m", prefill={"engine": {"num_blocks": -1}})
    with pytest.raises(ValueError, match="num_blockz"):
        PDServeConfig(model="m", decode={"engine": {"num_blockz": 1}})
    with pytest.raises(ValueError, match="block_size must be the same for prefill and decode"):
        PDServeConfig(model="m", decode={"engine": {"block_size": 32}})
    with pytest.raises(SystemExit):
        _subparser("serve").parse_args(["--decode-engine", "[1]"])


def test_kuberay_values_carry_engine_options_through_the_same_declaration():
    from pathlib import Path

    import yaml

    from deploy.manifests import ClusterValues, serve_config

    raw = yaml.safe_load((Path(__file__).parents[2] / "deploy/kuberay/values.yaml").read_text())
    raw["engine"] = {**raw.get("engine", {}), "cuda_graphs": False, "scheduling_policy": "priority"}
    args = serve_config(ClusterValues.model_validate(raw))["applications"][0]["args"]
    assert args["engine"]["cuda_graphs"] is False and args["engine"]["scheduling_policy"] == "priority"
    raw["engine"]["cuda_graph"] = False  # a typo of an option name is refused, not ignored
    with pytest.raises(ValueError, match="cuda_graph"):
        serve_config(ClusterValues.model_validate(raw))


def test_speculative_config_flag_reaches_decode_workers_only():
    from cli.serve_args import config_from_args

    spec = '{"method": "ngram", "num_speculative_tokens": 5}'
    args = _subparser("serve").parse_args(["--speculative-config", spec])
    config = config_from_args(args, "some/model", tiny=False)
    decode = config.engine_for("decode").engine_config(config.model)
    assert decode.speculative.method == "ngram" and decode.speculative.num_speculative_tokens == 5
    assert config.engine_for("prefill").engine_config(config.model).speculative is None
    with pytest.raises(SystemExit):  # not JSON: argparse refuses it with the reason
        _subparser("serve").parse_args(["--speculative-config", "{ngram"])
    with pytest.raises(ValueError, match="method must be one of"):
        PDServeConfig(model="m", engine={"speculative_config": {"method": "lookahead"}})


def test_the_default_layout_is_the_router_serving_http_with_a_front_end_per_eight_cores(monkeypatch):
    """``pdserve serve`` without flags serves HTTP from the router replicas (the fastest layout
    measured); their count follows the cores (1 on a small machine), ``--frontends`` overrides it
    and counts ingress replicas in the other layouts."""
    import cli.host_share
    from cli.serve_args import config_from_args

    parse = _subparser("serve").parse_args
    monkeypatch.setattr(cli.host_share, "usable_cores", lambda: 2)
    config = config_from_args(parse([]), "m", tiny=False)
    assert config.ingress.http_server == "router"
    assert (config.router.num_replicas, config.ingress.num_replicas) == (1, 1)
    monkeypatch.setattr(cli.host_share, "usable_cores", lambda: 16)
    assert config_from_args(parse([]), "m", tiny=False).router.num_replicas == 2
    direct = config_from_args(parse(["--http-server", "direct", "--frontends", "3"]), "m", tiny=False)
    assert (direct.router.num_replicas, direct.ingress.num_replicas) == (1, 3)
    with pytest.raises(SystemExit):
        parse(["--frontends", "0"])


def test_generate_submits_each_prompt_once_by_default():
    """Two prompts are two requests (``--repeat`` is for load, not the default)."""
    assert _subparser("generate").parse_args([]).repeat == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--repeat", "0"], "--repeat must be at least 1, got 0"),
        (["--top-k", "-5"], "top_k must be -1 or 0 (off) or a positive integer, at most 2147483647, got -5"),
        (["--device", "cuda:7"], "device 'cuda:7': this "),  # no torch here has 8 GPUs... or any
    ],
)
def test_generate_refuses_bad_values_in_one_line_before_loading_a_model(capsys, argv, says):
    from cli.main import main as pdserve

    assert pdserve(["generate", "--model", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and says in err.splitlines()[-1], err


def test_the_request_limits_are_serve_flags_that_reach_the_ingress():
    """The limits the docs cite (``--max-n``, ``--max-logprobs``, ...) exist and set the ingress."""
    from pydantic import ValidationError

    from cli.serve_args import config_from_args

    parse = _subparser("serve").parse_args
    defaults = config_from_args(parse([]), "m", tiny=False).ingress
    assert (defaults.max_n, defaults.max_logprobs, defaults.request_timeout_s) == (16, 20, 600.0)
    flags = ["--max-n", "4", "--max-logprobs", "5", "--max-body-bytes", "65536"]
    flags += ["--max-prompt-chars", "1000", "--request-timeout-s", "30"]
    ingress = config_from_args(parse(flags), "m", tiny=False).ingress
    assert (ingress.max_n, ingress.max_logprobs, ingress.max_body_bytes) == (4, 5, 65536)
    assert (ingress.max_prompt_chars, ingress.request_timeout_s) == (1000, 30.0)
    with pytest.raises(ValidationError, match="max_n"):
        config_from_args(parse(["--max-n", "0"]), "m", tiny=False)


def test_engine_threads_share_the_usable_cores_whatever_the_ray_cpus(monkeypatch):
    """``--ray-cpus`` beyond the cores makes room for replicas, not threads: each CPU engine of a
    local cluster gets its share of the cores this process may use, and the HTTP front ends follow
    the cores too."""
    import cli.host_share
    from cli.serve_args import config_from_args

    parse = _subparser("serve").parse_args
    monkeypatch.setattr(cli.host_share, "usable_cores", lambda: 2)
    threads = {
        flags: config_from_args(parse(list(flags)), "m", tiny=False).engine.cpu_threads
        for flags in ((), ("--ray-cpus", "8"), ("--ray-cpus", "8", "--decode", "3"), ("--ray-cpus", "1"))
    }
    assert list(threads.values()) == [1, 1, 1, 1]
    assert config_from_args(parse(["--ray-cpus", "64"]), "m", tiny=False).router.num_replicas == 1
    monkeypatch.setattr(cli.host_share, "usable_cores", lambda: 16)
    assert config_from_args(parse(["--ray-cpus", "64"]), "m", tiny=False).engine.cpu_threads == 8
    assert config_from_args(parse(["--ray-cpus", "4"]), "m", tiny=False).engine.cpu_threads == 2
    given = parse(["--ray-cpus", "64", "--cpu-threads", "3"])
    assert config_from_args(given, "m", tiny=False).engine.cpu_threads == 3


def test_a_bad_config_file_names_its_field_in_one_line(tmp_path):
    from cli.serve_args import config_from_file

    path = tmp_path / "pdserve.yaml"
    path.write_text("model: m\ncolour: red\n")
    with pytest.raises(ValueError) as exc:
        config_from_file(str(path), _subparser("serve").parse_args([]))
    assert str(exc.value) == f"invalid config file {path}: colour: Extra inputs are not permitted"


def test_lora_flags_add_up_and_a_name_given_twice_is_an_error(capsys):
    parser = _subparser("serve")
    args = parser.parse_args(["--lora", "a=/x", "--lora-modules", '{"b": "/y"}', "--lora", "c=/z"])
    assert args.lora_modules == {"a": "/x", "b": "/y", "c": "/z"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora", "a=/x", "--lora-modules", '{"a": "/y"}'])
    assert "the LoRA adapter 'a' is given twice" in capsys.readouterr().err


def test_an_adapter_under_the_served_models_name_is_refused():
    with pytest.raises(ValueError, match="the LoRA adapter 'tiny' has the served model's name"):
        PDServeConfig(model="m", served_model_name="tiny", engine={"lora_modules": {"tiny": "/a"}})
