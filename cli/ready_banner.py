"""What ``pdserve serve`` prints once the service is ready: where it is, how to try it, how to reach it."""

from __future__ import annotations

import json
import shlex

from cli.service_record import ServiceRecord
from deploy.config import PDServeConfig
from settings import environment


def ready_banner(config: PDServeConfig, record: ServiceRecord, api_key_from_flag: bool = False) -> str:
    """What ``serve`` prints once ready. The curl line works when pasted into a POSIX shell: the key
    is named as "$PDSERVE_API_KEY" (double quotes: the shell expands it), never printed."""
    base = record.endpoint
    body = json.dumps(
        {"model": config.model_name, "prompt": "the world is", "max_tokens": 16, "temperature": 0}
    )
    auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if environment.api_key() else ""
    lines = [f"\npdserve is serving {config.model_name!r} at {base}/v1", f"  {record.describe()}"]
    if config.tiny_model:
        lines.append(
            "  NOTE: this is a tiny random-weight demo model (no --model given): its text is meaningless"
        )
    lines.append(
        f"  try:    curl {base}/v1/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"
    )
    if auth and api_key_from_flag:
        lines.append("          (export PDSERVE_API_KEY=<the key given to --api-key> in that shell first)")
    lines.append(f"  health: {base}/health   metrics: {base}/metrics")
    lines.append(
        f"  workers: pdserve status --service {record.name}   scale: pdserve scale --service {record.name}"
    )
    lines.append("  Ctrl-C (or SIGTERM) drains in-flight requests and stops.\n")
    return "\n".join(lines)
