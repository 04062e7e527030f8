"""The banner ``pdserve serve`` prints once ready: its curl line works when pasted into a shell (the
API key expanded from ``$PDSERVE_API_KEY``, never printed), and it names the service."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from cli.ready_banner import ready_banner
from cli.service_record import ServiceRecord
from deploy.config import PDServeConfig

KEY = "sk-test-secret-key-42"


def curl_args(banner: str, env: dict[str, str]) -> list[str]:
    """The arguments the shell hands curl when the banner's line is pasted (curl replaced by printf)."""
    (line,) = [x.strip() for x in banner.splitlines() if x.strip().startswith("try:")]
    script = "curl() { printf '%s\\0' \"$@\"; }\n" + line.removeprefix("try:").strip()
    out = subprocess.run(
        [shutil.which("bash") or "bash", "-c", script], env=env, capture_output=True, check=True
    )
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("with_key", [True, False])
def test_the_curl_line_works_when_pasted(monkeypatch, with_key):
    if with_key:
        monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    else:
        monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    config = PDServeConfig(model="/models/it's-mine", tiny_model=True)
    record = ServiceRecord(
        "svc-1", "pdserve", "http://127.0.0.1:8123", "10.0.0.1:6379", pid=1, auth_token="tok"
    )
    banner = ready_banner(config, record)
    assert KEY not in banner and "tok" not in banner.replace("tokens", "")
    args = curl_args(banner, {"PDSERVE_API_KEY": KEY, "PATH": "/usr/bin:/bin"})
    assert args[0] == "http://127.0.0.1:8123/v1/completions"
    headers = [args[i + 1] for i, a in enumerate(args) if a == "-H"]
    auth = ["Authorization: Bearer " + KEY] if with_key else []
    assert headers == ["Content-Type: application/json", *auth]
    body = json.loads(args[args.index("-d") + 1])
    assert body["model"] == "/models/it's-mine" and body["max_tokens"] == 16
    assert "service 'svc-1'" in banner and "pdserve status --service svc-1" in banner
