"""``bench.step_launches``: a mixed step's kernel launches from Python grow with the model's depth
when the step runs eagerly, and stay the same few, plus one replay, through the graph path."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (see test_triton_kernels)

from bench.step_launches import mixed_step_launches

# A CPU proxy: it counts launches through Triton's interpreter, which a GPU host's test run does not use.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="counts launches under Triton's interpreter (CPU)"
)


def test_eager_launches_grow_with_depth_and_the_graph_path_does_not():
    one, two = mixed_step_launches(1, 2, 4), mixed_step_launches(2, 2, 4)
    # Each layer: 4 matmuls, 2 fused norms, rotary, the KV store, decode and prefill attention, SiLU*mul.
    assert two["eager"]["total"] - one["eager"]["total"] == 11 and two["eager"]["aten"]["linear"] == 8
    assert one["graph"] == two["graph"] and one["graph"]["replays"] == 1
    assert one["graph"]["triton"] == 0 and one["graph"]["total"] < one["eager"]["total"]
