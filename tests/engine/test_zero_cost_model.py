"""The zero-cost model: the real engine (scheduler, runner, sampler) around a model that computes
nothing, so its outputs follow a fixed walk and its steps run no layer and no attention."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import ZeroCostForCausalLM, create_zero_cost_model

VOCAB = 64


def _walk(last: int, n: int, stride: int = 1) -> list[int]:
    """The tokens after ``last``: ordinary ids (3..VOCAB-1) advanced by ``stride``, wrapping."""
    out = []
    for _ in range(n):
        last = 3 + (last - 3 + stride) % (VOCAB - 3) if last >= 3 else 3
        out.append(last)
    return out


@pytest.fixture(scope="module")
def zero_cost_dir(tmp_path_factory):
    return create_zero_cost_model(
        tmp_path_factory.mktemp("zero-cost"), vocab_size=VOCAB, max_position_embeddings=256
    )


def _all_free(llm: LLM) -> bool:
    s = llm.stats()
    return s.num_free_blocks == s.num_blocks and s.num_running == 0 and s.num_waiting == 0


def _count_compute(llm: LLM, monkeypatch) -> dict[str, int]:
    """Counts of decoder-layer calls and attention-backend calls during later steps."""
    counts = {"layers": 0, "attention": 0}
    runner = llm.core.runner
    for layer in runner.model.model.layers:
        layer.register_forward_pre_hook(lambda *_: counts.__setitem__("layers", counts["layers"] + 1))
    attend = runner.backend.forward

    def counting(*args, **kwargs):
        counts["attention"] += 1
        return attend(*args, **kwargs)

    monkeypatch.setattr(runner.backend, "forward", counting)
    return counts


def test_load_model_builds_it_from_the_checkpoint(zero_cost_dir):
    llm = LLM(str(zero_cost_dir), num_blocks=16, block_size=16)
    assert isinstance(llm.core.model, ZeroCostForCausalLM)
    assert llm.core.spec.vocab_size == VOCAB
    assert len(llm.tokenizer) >= VOCAB  # the tiny models' word-level tokenizer covers every id


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_follows_the_fixed_walk_and_frees_every_block(zero_cost_dir, temperature):
    llm = LLM(str(zero_cost_dir), num_blocks=32, block_size=4, max_num_batched_tokens=16)
    prompts = [[5, 6, 7], [60, 61, 62, 63], list(range(10, 40)), [1]]  # chunked, wrapping, special
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [_walk(p[-1], 12) for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)  # never EOS unless asked
    assert _all_free(llm)


def test_stride_and_eos_after_come_from_the_checkpoint(tmp_path):
    path = create_zero_cost_model(
        tmp_path, vocab_size=VOCAB, max_position_embeddings=128, stride=5, eos_after=20
    )
    llm = LLM(str(path), num_blocks=16, block_size=16)
    out = llm.generate([[3, 4, 10]], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert out.token_ids == [15, 20, 2]  # 10 -> 15 -> 20 -> EOS
    assert out.finish_reason == "stop"
    assert _all_free(llm)


def test_a_step_runs_no_layer_and_no_attention(zero_cost_dir, tiny_llama, monkeypatch):
    zero = LLM(str(zero_cost_dir), num_blocks=32, block_size=4)
    counts = _count_compute(zero, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = zero.generate([[5, 6, 7, 8, 9], [11, 12]], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert counts == {"layers": 0, "attention": 0}
    assert not zero.core.runner.kv_cache.any()  # no K/V was ever written
    # The same instruments on the tiny random model do see its layers and attention run.
    tiny = LLM(str(tiny_llama), num_blocks=32, block_size=4)
    tiny_counts = _count_compute(tiny, monkeypatch)
    tiny.generate([[5, 6, 7, 8, 9], [11, 12]], params, use_tqdm=False)
    assert tiny_counts["layers"] > 0 and tiny_counts["attention"] > 0
    assert tiny.core.runner.kv_cache.any()


def test_logits_are_a_one_hot_peak_at_the_successor():
    from engine.models.zero_cost import spec_from_config
    from engine.tiny_model import make_config

    spec = spec_from_config(make_config(vocab_size=VOCAB, max_position_embeddings=64))
    m = ZeroCostForCausalLM.from_spec(spec)
    ids = torch.tensor([0, 2, 3, 10, VOCAB - 1])
    hidden = m(ids, torch.arange(5), None, None)
    assert hidden.shape == (5, spec.hidden_size)
    logits = m.compute_logits(hidden)
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [3, 3, 4, 11, 3]
    assert (logits > 0).sum().item() == 5


def test_the_model_name_builds_it_once_for_every_process(tmp_path, monkeypatch):
    """``pdserve/zero-cost`` resolves to a checkpoint written once under the cache directory; a
    second resolution (another process's) reuses it, and other names are left alone."""
    import engine.model_names as names

    monkeypatch.setattr(names, "CACHE_DIR", tmp_path)
    assert names.builtin_model_dir("meta-llama/Llama-3.2-1B") is None
    path = names.builtin_model_dir(names.ZERO_COST)
    assert path == tmp_path / "zero-cost" and (path / "config.json").exists()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert names.builtin_model_dir(names.ZERO_COST) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp  # not rewritten
    assert [p.name for p in tmp_path.iterdir()] == ["zero-cost"]  # no private copy left behind
    llm = LLM(names.ZERO_COST, num_blocks=16, block_size=16)
    assert isinstance(llm.core.model, ZeroCostForCausalLM)
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == [7, 8, 9, 10]


def test_the_step_time_model_counts_tokens_and_causal_context_pairs():
    from engine.models.zero_cost import StepTime

    cost = StepTime(base_s=1.0, per_token_s=0.1, per_ctx_s=0.001)
    # Three decodes at contexts 10, 20, 30: one token each, attending their whole context.
    assert cost.seconds([0, 1, 2, 3], [10, 20, 30]) == pytest.approx(1.0 + 0.3 + 0.001 * 60)
    # A decode at context 8, then a 4-token chunk ending at context 12 (positions 8..11 attend
    # 9..12 keys: 42 pairs).
    assert cost.seconds([0, 1, 5], [8, 12]) == pytest.approx(1.0 + 0.5 + 0.001 * (8 + 42))
    with pytest.raises(ValueError, match="per_ctx_s"):
        StepTime(base_s=0.01, per_token_s=0.0, per_ctx_s=-1e-9)


def test_an_emulated_accelerator_waits_its_step_time_and_generates_the_walk(tmp_path, monkeypatch):
    """``pdserve/emulated``: the zero-cost walk, each forward waiting what its step's work costs
    (recorded here instead of slept)."""
    import engine.model_names as names
    from engine.models.zero_cost import StepTime

    monkeypatch.setattr(names, "CACHE_DIR", tmp_path)
    llm = LLM(names.EMULATED, num_blocks=16, block_size=4, max_num_batched_tokens=8)
    model = llm.core.model
    assert model.step_time == StepTime(**names.EMULATED_STEP_TIME)
    waits: list[float] = []
    model.sleep = waits.append
    out = llm.generate([list(range(10, 22))], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.token_ids == [22, 23, 24]
    cost = model.step_time
    # 12 prompt tokens in chunks of 8 and 4 (the second over 8 cached), then two decodes.
    expected = [cost.seconds([0, 8], [8]), cost.seconds([0, 4], [12]), cost.seconds([0, 1], [13]),
                cost.seconds([0, 1], [14])]  # fmt: skip
    assert waits == pytest.approx(expected)
    assert expected[0] == pytest.approx(0.020 + 8 * 0.0002 + 36 * 1e-7)
    assert _all_free(llm)
    written = json.loads((names.builtin_model_dir(names.EMULATED) / "config.json").read_text())
    assert written["pdserve_zero_cost"]["step_time"] == names.EMULATED_STEP_TIME
    assert [p.name for p in tmp_path.iterdir()] == [f"emulated-{names._COSTS}"]
