"""Multi-LoRA in the engine alone: greedy output token-identical to HF transformers + peft for each
adapter (float32, tiny random models and adapters written by peft itself), with several adapters and
the base model mixed in one batch, through chunked prefill, with fewer device slots than adapters
(swapped in LRU), and with the prefix cache never sharing KV across adapters. Adapters the engine
cannot serve exactly are refused with the reason."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.core_lora import UnknownAdapterError
from engine.lora.adapter import AdapterError

MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, lora_adapter_factory):
    """Three adapters of different shapes: every projection at rank 8; q and v at rank 4 with rsLoRA;
    the MLP at rank 16 with per-module alphas."""
    return {
        "all": lora_adapter_factory(tiny_llama, seed=1),
        "qv": lora_adapter_factory(tiny_llama, seed=2, r=4, targets=("q_proj", "v_proj"), use_rslora=True),
        "mlp": lora_adapter_factory(
            tiny_llama,
            seed=3,
            r=16,
            targets=("gate_proj", "up_proj", "down_proj"),
            # PEFT reads each key as a regular expression, the first match in the saved file's (sorted)
            # order winning: "down_proj|up_proj" is one expression (down and up at 48, not up at 2),
            # gate keeps lora_alpha.
            alpha_pattern={"down_proj|up_proj": 48, "up_proj": 2},
        ),
    }


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def _check(llm, model_dir, adapters, prompts, loras, hf_lora_greedy) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, lora=loras, use_tqdm=False)
    for prompt, name, out in zip(prompts, loras, outs):
        ref = hf_lora_greedy(model_dir, adapters[name] if name else None, prompt, MAX_NEW)
        assert out.token_ids == ref, f"adapter {name}: mismatch for a prompt of {len(prompt)} tokens"
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_each_adapter_changes_the_output(tiny_llama, adapters, hf_lora_greedy):
    prompt = _prompts(0, [12])[0]
    outs = {name: tuple(hf_lora_greedy(tiny_llama, path, prompt, MAX_NEW)) for name, path in adapters.items()}
    outs["base"] = tuple(hf_lora_greedy(tiny_llama, None, prompt, MAX_NEW))
    assert len(set(outs.values())) == len(outs), outs  # otherwise the parity below proves little


def test_mixed_adapters_in_one_batch_match_hf_peft(tiny_llama, adapters, hf_lora_greedy):
    llm = LLM(
        str(tiny_llama), block_size=8, num_blocks=128, lora_modules={k: str(v) for k, v in adapters.items()}
    )
    assert llm.core.list_loras() == ["all", "mlp", "qv"]
    loras = [None, "all", "qv", "mlp", "all", None, "qv", "mlp"]
    _check(llm, tiny_llama, adapters, _prompts(1, [1, 5, 8, 13, 29, 40, 17, 3]), loras, hf_lora_greedy)


def test_chunked_prefill_and_fewer_slots_than_adapters(tiny_llama, adapters, hf_lora_greedy):
    # One device slot for three adapters: the scheduler runs one adapter at a time (others wait,
    # base-model requests run beside it) and each is copied in when its turn comes.
    llm = LLM(
        str(tiny_llama),
        block_size=8,
        num_blocks=128,
        max_num_batched_tokens=16,
        max_loras=1,
        lora_modules={k: str(v) for k, v in adapters.items()},
    )
    loras = ["all", "qv", None, "mlp", "qv", "all"]
    _check(llm, tiny_llama, adapters, _prompts(2, [3, 17, 33, 9, 21, 40]), loras, hf_lora_greedy)
    assert llm.core.lora_slots.num_loads >= 3


def test_prefix_cache_never_shares_kv_across_adapters(tiny_llama, adapters, hf_lora_greedy):
    llm = LLM(
        str(tiny_llama), block_size=8, num_blocks=128, lora_modules={k: str(v) for k, v in adapters.items()}
    )
    prompt = _prompts(3, [40])
    for name in (
        None,
        "all",
        "qv",
        "all",
        None,
    ):  # each after the other: the cache holds the last one's blocks
        _check(llm, tiny_llama, adapters, prompt, [name], hf_lora_greedy)
    # Repeats under the same adapter hit the cache: the second "all" and the second base run.
    assert llm.stats().prefix_cache_hits >= 2 * 32


def test_unknown_adapter_and_removal_in_use(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, lora_modules={"all": str(adapters["all"])})
    with pytest.raises(UnknownAdapterError, match="'nope' does not exist"):
        llm.generate([[5, 6, 7]], lora="nope", use_tqdm=False)
    llm.core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, lora="all"))
    with pytest.raises(AdapterError, match="in use by 1 unfinished"):
        llm.core.remove_lora("all")
    llm.core.abort_request("r")
    llm.core.remove_lora("all")
    assert llm.core.list_loras() == []
    llm.core.add_lora("again", str(adapters["all"]))  # at run time
    assert llm.core.list_loras() == ["again"]


def _broken(src, tmp_path, config=None, tensors=None, name="broken"):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / name
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        weights = tensors(load_file(dst / "adapter_model.safetensors"))
        save_file(weights, dst / "adapter_model.safetensors")
    return dst


def _renamed(weights: dict, old: str, new: str) -> dict:
    return {k.replace(old, new): v for k, v in weights.items()}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(config={"use_dora": True}), "DoRA"),
        (dict(config={"bias": "lora_only"}), "adapted biases"),
        (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (dict(config={"peft_type": "IA3"}), "is not LoRA"),
        (dict(config={"r": 0}), "r must be a positive number"),
        (dict(tensors=lambda w: _renamed(w, "q_proj", "embed_tokens")), "not a projection pdserve adapts"),
        (
            dict(tensors=lambda w: {k: v for k, v in w.items() if "q_proj.lora_B" not in k}),
            "without its partner",
        ),
        (
            dict(
                tensors=lambda w: {
                    k: v[:, :-1].contiguous() if "k_proj.lora_A" in k else v for k, v in w.items()
                }
            ),
            "do not fit",
        ),
        (dict(tensors=lambda w: _renamed(w, "layers.1.", "layers.9.")), "has 2 layers"),
    ],
    ids=["dora", "bias", "modules_to_save", "not-lora", "rank-0", "embedding", "half-pair", "shape", "layer"],
)
def test_an_adapter_the_engine_cannot_serve_is_refused_with_the_reason(
    tiny_llama, adapters, tmp_path, change, reason
):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=32, enable_lora=True)
    with pytest.raises(AdapterError, match=reason):
        llm.core.add_lora("x", str(_broken(adapters["all"], tmp_path, **change)))
    assert llm.core.list_loras() == []


def test_rank_above_the_slots_and_pickled_checkpoints_are_refused(tiny_llama, adapters, tmp_path):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=32, enable_lora=True, max_lora_rank=8)
    with pytest.raises(AdapterError, match="rank 16 exceeds max_lora_rank 8"):
        llm.core.add_lora("mlp", str(adapters["mlp"]))
    pickled = _broken(adapters["all"], tmp_path)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="is a pickle"):
        llm.core.add_lora("bin", str(pickled))
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        llm.core.add_lora("none", str(tmp_path))


def test_an_adapter_written_by_pdserve_loads_in_peft_with_the_same_output(
    tiny_llama, tmp_path, hf_lora_greedy
):
    from engine.lora.adapter import random_adapter
    from engine.models.loader import load_hf_config, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(tiny_llama))
    path = random_adapter(tmp_path / "written", spec, rank=4, seed=5, scale=0.5)
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, lora_modules={"w": str(path)})
    _check(llm, tiny_llama, {"w": path}, _prompts(4, [9, 30]), ["w", "w"], hf_lora_greedy)
    prompt = _prompts(4, [9])[0]
    assert hf_lora_greedy(tiny_llama, path, prompt, MAX_NEW) != hf_lora_greedy(
        tiny_llama, None, prompt, MAX_NEW
    )


@pytest.mark.parametrize(
    ("slots", "path"),
    [
        ([1, 0, 2, 0, 1, 2], "padded"),  # decodes of 3 adapters, 2 each: batched matmuls, no mask
        ([0, -1, 1, 1, 1, 2], "padded+mask"),  # uneven: padding rows masked out
        ([0, 1, 2, -1], "padded+mask"),  # even, every slot used: a padding row for the base token
        ([0] * 20 + [1], "runs+loop"),  # a prefill chunk on its own rows, a decode beside it
        ([0] * 20 + [1, 2, -1, 1, 2], "runs+padded+mask"),  # a chunk, then decodes of two adapters
        ([2] * 17 + [-1] * 3 + [0] * 16, "runs"),  # two chunks of two adapters and a base one
    ],
)
def test_the_cpu_update_paths_equal_a_per_token_reference(slots, path):
    from types import SimpleNamespace

    import torch

    from engine.lora.batch import LoraBatch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 24, 16, generator=gen)  # two parts of rank 8 (q and k, say), fused
    parts = ((torch.randn(3, 8, 40, generator=gen), 0, 40), (torch.randn(3, 8, 24, generator=gen), 40, 64))
    x, y = torch.randn(len(slots), 24, generator=gen), torch.randn(len(slots), 64, generator=gen)
    want = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            for i, (b, lo, hi) in enumerate(parts):
                want[t, lo:hi] += x[t] @ a[s][:, 8 * i : 8 * (i + 1)] @ b[s]
    weights = SimpleNamespace(max_loras=3, layer_weights=lambda layer, proj: (a, parts))
    batch = LoraBatch.build(weights, slots, torch.device("cpu"))
    chosen = ["runs"] if batch.runs else []
    if batch.padded is not None:
        chosen.append("padded+mask" if batch.padded.mask is not None else "padded")
    elif batch.groups:
        chosen.append("loop")
    assert "+".join(chosen) == path
    batch.update(y, x, 0, "qkv")
    torch.testing.assert_close(y, want)


def test_pulled_prompts_of_more_adapters_than_slots_wait_for_one(tiny_llama, adapters, hf_lora_greedy):
    """Disaggregated roles in one process (the KV copied between engines as NIXL would): the decode
    engine has one adapter slot; two prompts of two adapters complete their pulls together, so the
    second waits with its KV in place until the first is done, and both equal HF + peft."""
    from engine import EngineConfig, EngineCore

    modules = {k: str(v) for k, v in adapters.items()}
    p = EngineCore(EngineConfig(model=str(tiny_llama), block_size=8, num_blocks=64, lora_modules=modules))
    d = EngineCore(
        EngineConfig(model=str(tiny_llama), block_size=8, num_blocks=64, lora_modules=modules, max_loras=1)
    )
    prompts = {"all": _prompts(5, [21])[0], "qv": _prompts(6, [13])[0]}
    tokens = {}
    for name, prompt in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora=name)
        p.add_request(name, prompt, params, prefill_only=True)
        first = next(o for _ in range(100) for o in p.step() if o.request_id == name)
        plan = d.add_transferred_request(name, prompt, first.new_token_ids[0], params, seed=first.seed)
        for i, local in enumerate(plan.local_block_ids):
            d.runner.kv_blocks[local].copy_(
                p.runner.kv_blocks[first.held_block_ids[plan.first_block_index + i]]
            )
        assert p.release_held(name)
        tokens[name] = list(first.new_token_ids)
    for name in prompts:
        d.complete_transfer(name)
    assert d.scheduler.parked == ["qv"]  # "all" runs in the one slot
    while d.has_unfinished():
        for out in d.step():
            tokens[out.request_id].extend(out.new_token_ids)
    for name, prompt in prompts.items():
        assert tokens[name] == hf_lora_greedy(tiny_llama, adapters[name], prompt, MAX_NEW), name
    assert d.stats().num_free_blocks == 64 and d.scheduler.parked == []


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 2},
    ],
    ids=["ngram", "early-exit"],
)
def test_adapters_under_speculative_decoding_and_parallel_samples(tiny_llama, adapters, hf_lora_greedy, spec):
    """Drafts are proposed without the adapter (n-grams, or the base model's first layers) and verified
    with it: greedy output is still HF + peft's; two parallel samples of an adapter fork its KV."""
    modules = {k: str(v) for k, v in adapters.items()}
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=128, lora_modules=modules, speculative_config=spec)
    prompts = _prompts(7, [9, 30, 17])
    repeating = [[5, 9, 9, 17] * 6]  # n-gram drafts find matches here
    _check(llm, tiny_llama, adapters, prompts + repeating, ["all", None, "qv", "mlp"], hf_lora_greedy)
    assert llm.stats().spec_draft_tokens > 0  # drafts were verified with the adapters
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    (out,) = llm.generate([prompts[0]], params, lora="mlp", use_tqdm=False)
    want = hf_lora_greedy(tiny_llama, adapters["mlp"], prompts[0], MAX_NEW)
    assert [o.token_ids for o in out.outputs] == [want, want]
    assert llm.stats().num_free_blocks == 128


@pytest.mark.parametrize(
    "patterns",
    [
        {"down_proj": 8},
        {"up_proj|down_proj": 24, "down_proj": 8},
        {"q_proj": 8, ".*_proj": 4},  # the first match wins, not the longest key
        {"layers.1.self_attn.q_proj": 3, "q_proj": 5},
        {"model.layers.0.mlp.gate_proj": 7},
        {"(gate|up)_proj": 9},
        {"proj": 2},  # matches no name: a key matches after a dot or the whole name
    ],
)
def test_per_module_alpha_picks_the_key_peft_picks(patterns):
    from peft.utils.other import get_pattern_key

    from engine.lora.adapter import _pattern

    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = get_pattern_key(patterns.keys(), f"model.layers.{layer}.{part}.{proj}")
            assert _pattern(patterns, layer, proj, 16) == patterns.get(key, 16), (layer, proj)


def test_a_pattern_that_is_no_regular_expression_is_refused():
    from engine.lora.adapter import _pattern

    with pytest.raises(AdapterError, match="'q_proj\\[' is not a regular expression"):
        _pattern({"q_proj[": 4}, 0, "q_proj", 16)
