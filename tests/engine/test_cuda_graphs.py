"""The CUDA-graph decode path: buckets, and the static-buffer path (padding, pad block) token-identical
to the plain path. On CPU it runs eagerly (capture=False) with the Triton kernels under their
interpreter; on a GPU the test also captures and replays real graphs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (see test_triton_kernels)

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.cuda_graphs import DecodeGraphRunner, batch_buckets

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256]
    with pytest.raises(ValueError):
        batch_buckets(0)


def _generate(core: EngineCore, prompts, params) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("capture", [False, True] if DEVICE == "cuda" else [False])
def test_static_decode_path_is_token_identical(tiny_llama, capture):
    cfg = dict(model=str(tiny_llama), block_size=8, num_blocks=48, attention_backend="triton", device=DEVICE)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [7, 8, 9], [100, 200, 300, 400, 500, 600]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = EngineCore(EngineConfig(**cfg, cuda_graphs=False))
    expected = _generate(plain, prompts, params)

    core = EngineCore(EngineConfig(**cfg, cuda_graphs=False))
    full = core.runner.kv_cache  # a view of the pool; the tensor behind it has the pad block
    with_pad = full.as_strided((full.shape[0] + 1, *full.shape[1:]), full.stride())
    graphs = DecodeGraphRunner(
        core.model, core.runner.backend, with_pad, 8, core.max_model_len, max_batch=4, capture=capture
    )
    with_pad[48].fill_(float("nan"))  # a real row reading the pad block would turn its output to NaN
    used = []
    run = graphs.run

    def counting_run(*a):
        used.append(len(a[2].seq_lens_list))
        return run(*a)

    graphs.run = counting_run
    core.runner.decode_graphs = graphs
    assert _generate(core, prompts, params) == expected
    assert 3 in used  # the three-sequence decode batch ran padded to the bucket of 4
    stats = core.stats()
    assert stats.num_free_blocks == 48
    # Every graph replay is counted as one, and the prompt steps (eager) as steps only.
    assert stats.num_graph_steps == len(used) and stats.num_steps > len(used)
    pad = with_pad[48]  # [layers, K/V, block_size, heads, head_dim]
    assert torch.isfinite(pad[:, :, 0]).all()  # the padded row wrote its K/V into slot 0 of the pad block
    assert torch.isnan(pad[:, :, 1:]).all()  # and nothing else wrote there


@pytest.mark.parametrize("capture", [False, True] if DEVICE == "cuda" else [False])
def test_adapter_decode_steps_run_from_the_graph_token_identical(tiny_llama, lora_adapter_factory, capture):
    """Decode steps mixing two adapters and the base model replay the graph path (per-token LoRA
    kernels reading the static slot buffer; a padding row in the bucket), token-identical to the
    eager path, which test_lora checks against HF transformers + peft."""
    adapters = {
        "a": str(lora_adapter_factory(tiny_llama, seed=11)),
        "b": str(lora_adapter_factory(tiny_llama, seed=12, r=4, targets=("q_proj", "v_proj", "down_proj"))),
    }
    cfg = dict(
        model=str(tiny_llama), block_size=8, num_blocks=48, attention_backend="triton", device=DEVICE,
        lora_modules=adapters, max_loras=2, cuda_graphs=False,
    )  # fmt: skip
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [7, 8, 9], [100, 200, 300, 400, 500, 600]]
    loras = ["a", None, "b"]

    def generate(core):
        out: dict[str, list[int]] = {}
        for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
            core.add_request(
                f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=lora)
            )
        while core.has_unfinished():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    expected = generate(EngineCore(EngineConfig(**cfg)))
    base = _generate(
        EngineCore(EngineConfig(**{**cfg, "lora_modules": {}})),
        prompts,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert expected["r0"] != base["r0"] and expected["r2"] != base["r2"]  # the adapters matter here
    assert expected["r1"] == base["r1"]

    core = EngineCore(EngineConfig(**cfg))
    full = core.runner.kv_cache
    with_pad = full.as_strided((full.shape[0] + 1, *full.shape[1:]), full.stride())
    graphs = DecodeGraphRunner(
        core.model, core.runner.backend, with_pad, 8, core.max_model_len, max_batch=4, capture=capture,
        lora=core.lora_slots,
    )  # fmt: skip
    used = []
    run = graphs.run

    def counting_run(*a):
        used.append((len(a[2].seq_lens_list), a[2].lora is not None))
        return run(*a)

    graphs.run = counting_run
    core.runner.decode_graphs = graphs
    assert generate(core) == expected
    assert (3, True) in used  # adapter decodes of three rows ran in the bucket of four
    assert core.stats().num_free_blocks == 48
