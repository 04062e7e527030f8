"""The default tiny model's cached checkpoint follows today's shape where it can without new weights."""

from __future__ import annotations

import json

from cli.tiny_model import _widen_context


def test_a_cached_model_with_a_shorter_context_gets_todays(tmp_path):
    short, long_ = tmp_path / "short.json", tmp_path / "long.json"
    short.write_text(json.dumps({"max_position_embeddings": 1024, "hidden_size": 512}))
    long_.write_text(json.dumps({"max_position_embeddings": 8192}))
    _widen_context(short, 4096)
    _widen_context(long_, 4096)
    assert json.loads(short.read_text()) == {"max_position_embeddings": 4096, "hidden_size": 512}
    assert json.loads(long_.read_text())["max_position_embeddings"] == 8192
