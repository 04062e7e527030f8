"""The committed protobuf/gRPC code is what ``scripts/gen_proto.sh`` makes from ``proto/pdserve.proto``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("pdserve_pb2.py", "pdserve_pb2_grpc.py", "pdserve_pb2.pyi")


def test_generated_code_is_current(tmp_path):
    (tmp_path / "proto").mkdir()
    shutil.copy(ROOT / "proto" / "pdserve.proto", tmp_path / "proto" / "pdserve.proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            "proto/pdserve.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (ROOT / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run scripts/gen_proto.sh and commit the result"


def test_messages_round_trip():
    from proto import pdserve_pb2 as pb

    handle = pb.KVHandle(
        request_id="r1", worker_id="p0", epoch=3, block_ids=[4, 5, 9], num_tokens=40, first_token=17
    )
    resp = pb.GenerateResponse(finished=pb.Finished(finish_reason="stop", usage=pb.Usage(prompt_tokens=40)))
    assert pb.KVHandle.FromString(handle.SerializeToString()) == handle
    assert pb.GenerateResponse.FromString(resp.SerializeToString()).WhichOneof("kind") == "finished"
