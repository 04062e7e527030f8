"""``pdserve bench`` refuses a value it cannot use in one line naming the flag (exit status 2), before
it sends anything: unchecked, ``--max-concurrency -2`` hung (no connection slot ever free),
``--sweep 0`` labelled a level "concurrency 0", ``--request-rate 0`` ran a closed loop unasked, and
the others ended in a traceback from deep inside (a gamma shape of 0, a missing file, a URL without
its scheme, ``randrange`` over no prefixes)."""

from __future__ import annotations

import socket

import pytest

from cli.main import build_parser
from cli.main import main as pdserve


@pytest.fixture(scope="module")
def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again once the block ends: nothing listens there
    return f"http://127.0.0.1:{port}"


def _refusal(capsys, argv: list[str]) -> str:
    """The last line ``pdserve bench ARGV`` writes, having checked it ends with status 2, no traceback."""
    code = pdserve(["bench", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.splitlines()[-1]


def _parse_refusal(capsys, argv: list[str]) -> str:
    """Argparse's refusal, checked by parsing alone: a value let through would be run (and
    ``--max-concurrency -2`` waits forever for a connection slot)."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-concurrency", "-2"], "argument --max-concurrency: must be at least 1, got -2"),
        (["--max-concurrency", "0"], "argument --max-concurrency: must be at least 1, got 0"),
        (["--sweep", "0"], "argument --sweep: every level must be at least 1, got 0"),
        (["--sweep", "1,4,-1"], "argument --sweep: every level must be at least 1, got 1,4,-1"),
        (["--sweep", "1,x"], "argument --sweep: expected comma-separated integers"),
        (["--request-rate", "5", "--burstiness", "0"], "argument --burstiness: must be a finite number > 0"),
        (["--request-rate", "-1"], "argument --request-rate: must be a finite number > 0, got -1"),
        (["--request-rate", "0"], "got 0 (leave --request-rate out for a closed loop)"),
        (
            ["--dataset", "prefix", "--num-prefixes", "0"],
            "argument --num-prefixes: must be at least 1, got 0",
        ),
        (["--goodput", "e2e:0"], "argument --goodput: expected ttft:MS, tpot:MS or e2e:MS with MS > 0"),
        (["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    ],
)
def test_a_value_out_of_range_is_refused_in_one_line(capsys, flags, says):
    assert says in _parse_refusal(capsys, ["--base-url", "http://127.0.0.1:8000", *flags])


def test_a_base_url_without_its_scheme_is_refused_in_one_line(capsys):
    for bare in ("127.0.0.1:18000", "localhost:8000", "http://"):
        says = f"needs http:// or https:// and a host, e.g. http://127.0.0.1:8000, got '{bare}'"
        assert f"argument --base-url: {says}" in _parse_refusal(capsys, ["--base-url", bare])


def test_a_sharegpt_file_that_is_missing_or_not_json_is_refused_in_one_line(capsys, closed_url, tmp_path):
    """(Checked before anything is sent: a refusal let through would end at the closed port, status 1.)"""
    missing = tmp_path / "nonexistent.json"
    sharegpt = ["--base-url", closed_url, "--dataset", "sharegpt", "--dataset-path"]
    assert (
        _refusal(capsys, [*sharegpt, str(missing)])
        == f"error: --dataset-path {missing}: No such file or directory"
    )
    missing.write_text("{not json")
    assert f"error: --dataset-path {missing} is not a JSON file" in _refusal(
        capsys, [*sharegpt, str(missing)]
    )
