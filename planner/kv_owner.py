"""The other end of ``pdserve profile``'s KV transfer measurement: a process holding KV blocks of the
profiled engine's layout behind a NIXL agent, as a prefill worker does, for the profile to READ.

Run by ``planner.profile.measure_transfer`` with the layout as JSON in ``argv[1]``; prints one JSON
line (its agent's name, NIXL metadata in hex, base address, block size and count, memory type) and
lives until its stdin closes. JSON on the pipe, never pickle.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    offers = os.fdopen(os.dup(1), "w", buffering=1)  # the one JSON line; whatever else prints: stderr
    os.dup2(2, 1)
    import torch

    from kv_transfer import KVCompat
    from kv_transfer.nixl_backend import NixlBackend

    spec = json.loads(sys.argv[1])
    kv = torch.randn(spec["shape"], device=spec["device"]).to(getattr(torch, spec["dtype"]))
    with NixlBackend("profile-owner", kv, KVCompat(**spec["compat"]), progress_thread=True) as backend:
        info = backend.local_info()
        offer = {
            "agent": info.agent_name,
            "metadata": info.agent_metadata.hex(),
            "base_addr": info.base_addr,
            "block_bytes": info.block_bytes,
            "num_blocks": info.num_blocks,
            "mem_type": info.mem_type,
            "device_id": info.device_id,
        }
        offers.write(json.dumps(offer) + "\n")
        sys.stdin.read()  # until the profile is done


if __name__ == "__main__":
    main()
