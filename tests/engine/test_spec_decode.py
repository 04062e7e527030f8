"""Speculative decoding in the engine: every method keeps greedy output token-identical to HF
transformers and to non-speculative decoding through the engine's hard paths (chunked prefill,
prefix caching, preemption, n > 1, stop conditions, logprobs); rejected drafts leave no trace in the
KV cache; a draft the target fully agrees with is fully accepted; refusals are clear.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.models import create_zero_cost_model
from engine.spec_config import SpeculativeConfig
from engine.spec_decode import NgramProposer

MAX_NEW = 24


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return tiny_model_factory("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def draft(tiny_model_factory):
    return tiny_model_factory("llama", num_hidden_layers=1, seed=7)


def _configs(target, draft) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "early_exit": {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        "draft_is_target": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4},
    }


METHODS = ["ngram", "early_exit", "draft_model", "draft_is_target"]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for n in lengths:  # repeated phrases, so prompt lookup finds something to propose
        phrase = [rng.randrange(3, 1024) for _ in range(5)]
        out.append([rng.randrange(3, 1024) for _ in range(n % 7)] + phrase * (n // 5))
    return out


def _greedy(max_new: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, **kw)


def _llm(model, spec: dict | None, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    return LLM(str(model), speculative_config=spec, **kw)


def _assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_greedy_matches_hf_and_non_speculative(target, draft, hf_greedy, method):
    prompts = _prompts(1, [3, 11, 26, 41])
    llm = _llm(target, _configs(target, draft)[method])
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(target, prompt, MAX_NEW)
        assert out.finish_reason == "length"
    stats = llm.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_draft_tokens > 0
    _assert_all_free(llm)


def test_a_draft_equal_to_the_target_is_always_accepted(target):
    llm = _llm(target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4})
    llm.generate(_prompts(2, [9, 17]), _greedy(max_new=21), use_tqdm=False)
    stats = llm.stats()
    # 21 tokens: the first from the prompt, then 4 steps of 4 drafts + 1 bonus.
    assert stats.spec_acceptance_rate == 1.0
    assert stats.spec_num_drafts == 2 * 4
    assert stats.spec_mean_accepted_length == 5.0
    assert stats.spec_accepted_per_position == (8, 8, 8, 8)
    assert stats.generation_tokens == 2 * 21
    _assert_all_free(llm)


def test_a_random_draft_is_mostly_rejected_and_output_is_unchanged(target, draft, hf_greedy):
    llm = _llm(target, _configs(target, draft)["draft_model"])
    prompt = _prompts(3, [14])[0]
    assert llm.generate([prompt], _greedy(), use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(
        target, prompt, MAX_NEW
    )
    stats = llm.stats()
    assert stats.spec_acceptance_rate < 0.5  # a different random model: its guesses are mostly wrong
    assert stats.spec_num_drafts >= MAX_NEW // 5
    _assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model"])
def test_chunked_prefill_prefix_caching_and_preemption(target, draft, method):
    """A small token budget (chunks), shared prefixes (cache hits) and a pool too small for the
    batch (preemption by recompute, then by swap): every output still equals non-speculative."""
    shared = _prompts(4, [20])[0]
    prompts = [shared + p for p in _prompts(5, [3, 9, 14, 30, 6, 22])]
    expected = [
        o.outputs[0].token_ids for o in _llm(target, None).generate(prompts, _greedy(), use_tqdm=False)
    ]
    spec = _configs(target, draft)[method]
    for kw in (
        {"max_num_batched_tokens": 16},
        {"num_blocks": 40, "max_num_batched_tokens": 64},
        {"num_blocks": 40, "swap_space": 0.01},
    ):
        llm = _llm(target, spec, **kw)
        outs = llm.generate(prompts, _greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, kw
        _assert_all_free(llm)
        if "num_blocks" in kw:
            assert llm.stats().num_preemptions > 0, kw


def test_rejected_drafts_never_reach_the_prefix_cache(target, draft, hf_greedy):
    """Blocks filled during speculation are cached only with accepted tokens: a follow-up whose
    prompt extends the first request's output hits those blocks and still matches HF."""
    llm = _llm(target, _configs(target, draft)["draft_model"], block_size=4)
    prompt = _prompts(6, [10])[0]
    first = llm.generate([prompt], _greedy(max_new=30), use_tqdm=False)[0]
    follow = prompt + first.outputs[0].token_ids + [7, 8]
    out = llm.generate([follow], _greedy(max_new=8), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 32  # the first request's blocks, speculated over, were hit
    assert out.outputs[0].token_ids == hf_greedy(target, follow, 8)
    assert llm.stats().spec_acceptance_rate < 1.0  # there were rejections to roll back
    _assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_n_greater_than_one_stop_conditions_and_logprobs(target, draft, method):
    prompts = _prompts(7, [12, 25])
    base = _llm(target, None)
    llm = _llm(target, _configs(target, draft)[method])
    ref = base.generate(prompts, _greedy(logprobs=2), use_tqdm=False)
    stop_at = ref[0].outputs[0].token_ids[9]
    cases = [
        _greedy(n=2),  # forks share the prompt's blocks; each speculates on its own
        _greedy(logprobs=2),
        _greedy(stop_token_ids=[stop_at]),  # a stop token inside an accepted run truncates it
        _greedy(max_new=7),
    ]
    for params in cases:
        want = base.generate(prompts, params, use_tqdm=False)
        got = llm.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            for wc, gc in zip(w.outputs, g.outputs, strict=True):
                assert gc.token_ids == wc.token_ids
                assert gc.finish_reason == wc.finish_reason and gc.stop_reason == wc.stop_reason
                if params.logprobs is not None:
                    assert len(gc.logprobs) == len(gc.token_ids)
                    for lw, lg in zip(wc.logprobs, gc.logprobs):
                        assert lw.keys() == lg.keys()
                        assert all(abs(lw[t] - lg[t]) < 1e-3 for t in lw)
    _assert_all_free(llm)


def test_per_request_opt_out_and_logits_processing_decode_one_token_per_step(target, draft):
    llm = _llm(target, _configs(target, draft)["draft_model"])
    prompt = _prompts(8, [15])[0]
    llm.generate([prompt], _greedy(speculative=False), use_tqdm=False)
    llm.generate([prompt], _greedy(presence_penalty=0.5), use_tqdm=False)
    assert llm.stats().spec_num_drafts == 0
    llm.generate([prompt], _greedy(), use_tqdm=False)
    assert llm.stats().spec_num_drafts > 0
    _assert_all_free(llm)


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # latest 3-gram match wins
    assert p.lookup([4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert p.lookup([7, 1, 9, 2, 9], 2) == [2, 9]  # only the 1-gram 9 matches
    assert p.lookup([1, 2, 3, 4], 3) == []
    assert p.lookup([5], 3) == []


def test_ngram_drafts_on_a_repeating_output_are_accepted(tmp_path):
    """On the zero-cost model's walk (ids 3..15, over and over) everything after the prompt repeats
    what followed the last occurrence of its suffix: the n-gram drafts must nearly all be accepted
    (a draft shifted by one position is always wrong) and the output stays the walk."""
    model = create_zero_cost_model(tmp_path / "walk", vocab_size=16)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = _llm(model, spec, num_blocks=64)
    out = llm.generate([list(range(3, 16))], _greedy(max_new=39), use_tqdm=False)[0]
    assert out.token_ids == [3 + i % 13 for i in range(39)]
    stats = llm.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_acceptance_rate >= 0.9
    _assert_all_free(llm)


def test_rejected_drafts_are_rolled_back_after_every_step(tmp_path):
    """The prompt's earlier "5 -> 9" makes the n-gram draft after 5 wrong on the walk (5 -> 6): after
    every step each running request has computed exactly its tokens but the last (a rejected draft's
    position counted as computed would make the next step skip a token)."""
    model = create_zero_cost_model(tmp_path / "walk", vocab_size=16)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = _llm(model, spec, num_blocks=64)
    core = llm.core
    core.add_request("r", [5, 9, 10, 3, 4, 5], _greedy(max_new=30))
    checked = 0
    while core.has_unfinished():
        core.step()
        for req in core.scheduler.running:
            assert req.num_computed_tokens == req.num_tokens - 1, req
            checked += 1
    stats = llm.stats()
    assert checked and stats.spec_num_drafts > 0 and stats.spec_acceptance_rate < 1.0
    _assert_all_free(llm)


def test_bad_speculative_configs_are_refused(target, tiny_model_factory):
    for bad, msg in [
        ({"method": "medusa"}, "method must be one of"),
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "typo": 1}, "unknown keys"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="fewer than the target's 3 layers"):
        _llm(target, {"method": "early_exit", "num_layers": 3})
    other_vocab = tiny_model_factory("llama", num_hidden_layers=1, vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary of 512 tokens but the target has 1024"):
        _llm(target, {"method": "draft_model", "model": str(other_vocab)})


def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path):
    """Same vocabulary size, two token strings swapped: refused at start-up."""
    import json
    import shutil

    other = tmp_path / "draft"
    shutil.copytree(target, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (w for w, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="different tokenizer"):
        _llm(target, {"method": "draft_model", "model": str(other)})


def test_speculation_pauses_while_the_batch_is_large(target):
    """disable_by_batch_size=2: no drafts while two requests run; the long one speculates alone."""
    spec = {
        "method": "draft_model",
        "model": str(target),
        "num_speculative_tokens": 2,
        "disable_by_batch_size": 2,
    }
    prompts = _prompts(9, [8, 12])
    llm = _llm(target, spec)
    even = llm.generate(prompts, _greedy(max_new=12), use_tqdm=False)
    assert llm.stats().spec_num_drafts == 0
    long_tail = [_greedy(max_new=4), _greedy(max_new=20)]
    outs = llm.generate(prompts, long_tail, use_tqdm=False)
    stats = llm.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_acceptance_rate == 1.0
    assert outs[1].outputs[0].token_ids[:12] == even[1].outputs[0].token_ids
    _assert_all_free(llm)


def test_a_stop_string_inside_an_accepted_run_ends_the_output_where_it_would_have(target):
    """Fully accepted runs of 5 tokens: a stop string completed by the run's third token drops the
    two after it, as if the tokens had come one per step."""
    plain = _llm(target, None)
    llm = _llm(target, _configs(target, None)["draft_is_target"])
    prompt = _prompts(10, [12])[0]
    ref = plain.generate([prompt], _greedy(max_new=40), use_tqdm=False)[0].outputs[0]
    words = [plain.tokenizer.decode([t]).strip() for t in ref.token_ids]
    word = next(w for i, w in enumerate(words) if i >= 5 and w not in words[:i])
    params = _greedy(max_new=40, stop=[word], logprobs=1)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert want.stop_reason == word and len(want.token_ids) < 40
    assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, want.stop_reason)
    assert len(got.logprobs) == len(got.token_ids)
    assert llm.stats().spec_accepted_tokens > 0
    _assert_all_free(llm)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_speculation_over_a_quantized_kv_cache_keeps_greedy_output(target, draft, method, kv_dtype):
    """Over an int8 or fp8 KV cache, speculation gives the non-speculating quantized engine's tokens:
    a token's stored bytes depend on that token alone (a scale per token, ``engine.kv_quant``), so
    a verify step writing k + 1 positions, its rejected drafts rewritten later, leaves nothing behind.
    (With a scale per block, a rejected draft's magnitude stayed in its block: ngram and early exit,
    which reject often, changed greedy output.) Also: a model proposer runs over such a cache (it
    failed at start, reading the device of a cache that is a region, not a tensor)."""
    prompts = _prompts(3, [11, 26, 40, 17])
    want = _llm(target, None, kv_cache_dtype=kv_dtype).generate(prompts, _greedy(max_new=32), use_tqdm=False)
    llm = _llm(target, _configs(target, draft)[method], kv_cache_dtype=kv_dtype)
    got = llm.generate(prompts, _greedy(max_new=32), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.stats()
    assert stats.spec_num_drafts > 0  # (the random draft model's proposals are all rejected)
    assert stats.spec_accepted_per_position[0] > 0 or method == "draft_model"
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens or method == "draft_is_target"  # rejections
    _assert_all_free(llm)
