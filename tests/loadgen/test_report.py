"""``pdserve bench``'s printed report: a run where every request failed says so instead of printing
zero latencies, and the goodput line states its SLOs in words (not a Python dict)."""

from __future__ import annotations

from loadgen.serving_client import RequestResult, print_report, summarize


def test_a_run_with_no_completed_request_prints_no_latencies(capsys):
    failed = [RequestResult(ok=False, error="HTTP 503: the service is shutting down")] * 3
    print_report(summarize(failed, 1.0, {}, 4, None))
    out = capsys.readouterr().out
    assert "0 ok, 3 failed" in out and "error: HTTP 503" in out
    assert "no request completed: no latencies" in out and "TTFT" not in out


def test_the_goodput_line_names_its_slos(capsys):
    done = [RequestResult(ok=True, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1])]
    print_report(summarize(done, 1.0, {"ttft": 500.0, "tpot": 50.0}, 1, None))
    out = capsys.readouterr().out
    assert "goodput 0.00 req/s within TTFT <= 500 ms, TPOT <= 50 ms" in out  # TPOT 100 ms misses
    assert "TTFT  mean    100.0" in out


def test_an_e2e_slo_counts_in_goodput(capsys):
    """``--goodput e2e:MS`` was accepted and printed, and a request over it still counted as good."""
    from cli.main import build_parser

    args = build_parser().parse_args(
        ["bench", "--base-url", "http://h:8000", "--goodput", "ttft:500", "e2e:250"]
    )
    within = RequestResult(ok=True, output_tokens=3, ttft_s=0.1, e2e_s=0.2, itl_s=[0.05, 0.05])
    over = RequestResult(ok=True, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1])  # E2E 300 ms
    print_report(summarize([within, over], 1.0, dict(args.goodput), 2, None))
    assert "goodput 1.00 req/s within TTFT <= 500 ms, E2E <= 250 ms" in capsys.readouterr().out
