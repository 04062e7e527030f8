"""Kernel launches a step issues from Python, eager against replayed from the CUDA graphs: a CPU proxy
for what a GPU step costs the host (each launch is a few microseconds of Python and driver work,
where a replay is one).

A mixed step (``--decodes`` running sequences and one new ``--prompt``-token prompt) of a random
Llama with ``--layers`` layers (20: the ~0.3B model's depth; small widths, so it runs on CPU) is
taken from a real engine step. Then it is counted twice:

- eagerly, with the fused Triton ops a GPU runs: aten ops that launch a kernel (views and
  allocations excluded) plus Triton launches;
- through ``DecodeGraphRunner.run``, outside the captured forward: the copies into the static
  buffers and the device-side context lengths and table rows. On a GPU the forward is one replay.

Triton runs under its interpreter, and the ops the interpreter itself issues are not counted:

    TRITON_INTERPRET=1 python -m bench.step_launches
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig, EngineCore, SamplingParams
from engine.cuda_graphs import DecodeGraphRunner
from engine.tiny_model import create_tiny_model

# aten ops that launch no kernel: views, metadata and allocations.
NO_KERNEL = frozenset(
    [
        "view",
        "_unsafe_view",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "t",
        "transpose",
        "reshape",
        "expand",
        "as_strided",
        "unsqueeze",
        "squeeze",
        "permute",
        "detach",
        "alias",
        "unbind",
        "narrow",
        "empty",
        "empty_like",
        "empty_strided",
        "lift_fresh",
        "promote_types",
    ]
)


class Launches(TorchDispatchMode):
    """Counts kernel-launching aten ops by name, and Triton launches, while active."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: dict[str, int] = {}
        self.triton = 0
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and not self._in_triton:  # not the interpreter's own tensor work
            self.aten[name] = self.aten.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def count_triton(self):
        """Patch the interpreter's launches to count them; returns the function that undoes it."""
        import triton.runtime.interpreter as interp

        original = interp.InterpretedFunction.__getitem__
        counter = self

        def counting(kernel, grid):
            launch = original(kernel, grid)

            def run(*a, **k):
                counter.triton += 1
                counter._in_triton += 1
                try:
                    return launch(*a, **k)
                finally:
                    counter._in_triton -= 1

            return run

        interp.InterpretedFunction.__getitem__ = counting
        return lambda: setattr(interp.InterpretedFunction, "__getitem__", original)

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + self.triton


def mixed_step_launches(layers: int, decodes: int, prompt: int) -> dict:
    from engine.attention.triton_kernels import is_interpreted

    if not is_interpreted():  # the count patches the interpreter's launches; the step runs on CPU
        raise SystemExit("run with TRITON_INTERPRET=1 (the step runs on CPU, Triton under its interpreter)")
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(
            Path(tmp) / "m", "llama", num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
        )  # fmt: skip
        core = EngineCore(
            EngineConfig(
                model=str(model), block_size=16, num_blocks=decodes * 8 + 16, attention_backend="triton",
                cuda_graphs=False, device="cpu",
            )
        )  # fmt: skip
        full = core.runner.kv_cache
        with_pad = full.as_strided((full.shape[0] + 1, *full.shape[1:]), full.stride())
        graphs = DecodeGraphRunner(  # the engine's default buckets (a step pads to the next)
            core.model, core.runner.backend, with_pad, 16, core.max_model_len, max_batch=256, capture=False
        )
        seen = []
        run = graphs.run

        def keep_mixed(input_ids, positions, meta):
            if meta.num_decodes == decodes < len(meta.seq_lens_list) and not seen:
                seen.append((input_ids.clone(), positions.clone(), meta))
            return run(input_ids, positions, meta)

        graphs.run = keep_mixed
        core.runner.decode_graphs = graphs
        long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for i in range(decodes):
            core.add_request(f"d{i}", [3 + (i * 7 + j) % 400 for j in range(20)], long)
        core.step()  # the prompts
        core.step()  # a decode step
        core.add_request("p", [5 + j for j in range(prompt)], SamplingParams(temperature=0, max_tokens=1))
        core.step()  # the mixed step
        input_ids, positions, meta = seen[0]
        eager, replay = Launches(), Launches()
        undo = eager.count_triton()
        try:
            with torch.inference_mode(), eager:
                core.model(input_ids, positions, core.runner.kv_cache, meta, fused=True)
            graphs._forward = lambda bucket: torch.zeros(bucket, 1)  # the captured part: one replay
            undo()
            undo = replay.count_triton()
            with torch.inference_mode(), replay:
                DecodeGraphRunner.run(graphs, input_ids, positions, meta)
        finally:
            undo()
        replay.aten.pop("zeros", None)  # the stand-in for the replay
        return {
            "layers": layers,
            "decodes": decodes,
            "prompt": prompt,
            "eager": {"total": eager.total, "triton": eager.triton, "aten": eager.aten},
            "graph": {"total": replay.total + 1, "triton": replay.triton, "aten": replay.aten, "replays": 1},
        }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.step_launches", description=__doc__)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--decodes", type=int, default=31)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = mixed_step_launches(a.layers, a.decodes, a.prompt)
    e, g = out["eager"], out["graph"]
    print(f"mixed step, {a.layers} layers, {a.decodes} decodes + a {a.prompt}-token prompt:")
    print(f"  eager: {e['total']} launches ({e['triton']} Triton, aten {e['aten']})")
    print(f"  graph: {g['total']} launches (1 replay, aten {g['aten']})")
    print(f"  eager / graph: {e['total'] / g['total']:.1f}x")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
