"""Penalties, logit_bias, min_tokens and bad words: greedy tokens equal a plain reference of each rule
applied to HF transformers' logits, alone and in mixed batches, resumed mid-request, and through
chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.logits_processing import LogitsAdjustment, RowHistory

PROMPTS = [[5, 9, 9, 17, 3, 3, 3, 40], [100, 7, 7, 250, 31, 31, 2, 8, 90, 12, 13]]
MAX_TOKENS = 12


def reference_processed(
    logits: list[float], prompt: list[int], out: list[int], p: SamplingParams, eos: set[int]
):
    """The rules as OpenAI / vLLM document them, one token at a time in plain Python."""
    x = list(logits)
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(out) >= len(prefix) and out[-len(prefix) :] == prefix):
            x[word[-1]] = float("-inf")
    if len(out) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos)):
            x[t] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        count = out.count(t)
        if p.repetition_penalty != 1 and (count or t in prompt):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count
        if count:
            x[t] -= p.presence_penalty
    return x


@pytest.fixture(scope="module")
def hf_processed_greedy(tiny_llama):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def ref(prompt: list[int], p: SamplingParams, eos: set[int], prior: list[int] = ()) -> list[int]:
        out = list(prior)
        with torch.no_grad():
            while len(out) - len(prior) < p.max_tokens:
                logits = model(torch.tensor([prompt + out])).logits[0, -1].tolist()
                x = reference_processed(logits, prompt, out, p, eos)
                tok = max(range(len(x)), key=lambda t: x[t])
                out.append(tok)
                if tok in p.stop_token_ids or (tok in eos and not p.ignore_eos):
                    break
        return out[len(prior) :]

    return ref


CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "negative_presence": dict(presence_penalty=-2.0, frequency_penalty=-0.5),
    "logit_bias": dict(logit_bias={11: 30.0, 12: 25.0, 40: -100.0}),
    "bad_words": dict(bad_words_token_ids=[[987], [95, 862], [294, 294, 294]]),
    "all": dict(
        presence_penalty=0.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        logit_bias={77: 8.0},
        bad_words_token_ids=[[5]],
        min_tokens=4,
        stop_token_ids=[77],
    ),
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_blocks=256, block_size=4)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_reference(llm, hf_processed_greedy, case):
    params = _greedy(**CASES[case])
    eos = set(llm.core.eos_token_ids)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    plain = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    changed = False
    for prompt, out, base in zip(PROMPTS, outs, plain):
        assert out.outputs[0].token_ids == hf_processed_greedy(prompt, params, eos)
        changed |= out.outputs[0].token_ids != base.outputs[0].token_ids
    assert changed, f"{case} did not change any output: the test would not notice it being ignored"


def test_mixed_batch_leaves_other_rows_alone(llm, hf_processed_greedy, hf_greedy, tiny_llama):
    eos = set(llm.core.eos_token_ids)
    plist = [_greedy(**CASES["all"]), _greedy(), _greedy(**CASES["frequency"]), _greedy(ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    outs = llm.generate(prompts, plist, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_processed_greedy(prompts[0], plist[0], eos)
    assert (
        outs[1].outputs[0].token_ids
        == hf_greedy(tiny_llama, prompts[1], MAX_TOKENS)[: len(outs[1].outputs[0].token_ids)]
    )
    assert outs[2].outputs[0].token_ids == hf_processed_greedy(prompts[2], plist[2], eos)
    assert outs[3].outputs[0].token_ids == hf_greedy(tiny_llama, prompts[3], MAX_TOKENS)


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    eos = sorted(llm.core.eos_token_ids)
    forced = eos[0] if eos else 1
    stop_kw = {} if eos else {"stop_token_ids": [forced]}
    # The bias makes the end token the argmax at every step: only min_tokens keeps it away.
    free = llm.generate(PROMPTS[0], _greedy(logit_bias={forced: 100.0}, **stop_kw), use_tqdm=False)[0]
    assert free.outputs[0].token_ids == [forced]
    held = llm.generate(
        PROMPTS[0], _greedy(logit_bias={forced: 100.0}, min_tokens=5, **stop_kw), use_tqdm=False
    )
    toks = held[0].outputs[0].token_ids
    assert len(toks) == 6 and forced not in toks[:5] and toks[5] == forced
    assert held[0].outputs[0].finish_reason == "stop"


def test_resumed_request_counts_its_earlier_output(llm):
    """A request moved mid-stream carries its tokens so far in the prompt, its budgets (max_tokens,
    min_tokens) lowered by them; with prior_output_tokens the penalties and bad words still count
    them as output, so the rest equals the uninterrupted run."""
    kw = dict(presence_penalty=-2.0, frequency_penalty=-1.0, logit_bias={2: 100.0})
    params = _greedy(**kw, bad_words_token_ids=[[95, 862], [881]], min_tokens=10)
    whole = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(whole) > 8
    core: EngineCore = llm.core
    k = 5
    resumed = params.continued(k)
    assert (resumed.max_tokens, resumed.min_tokens, resumed.prior_output_tokens) == (
        MAX_TOKENS - k,
        10 - k,
        k,
    )
    unmarked = SamplingParams(**{**_as_kwargs(resumed), "prior_output_tokens": 0})
    for rest, expect_equal in ((resumed, True), (unmarked, False)):
        core.add_request(f"resumed-{rest.prior_output_tokens}", PROMPTS[1] + whole[:k], rest)
        got = []
        while core.has_unfinished():
            for out in core.step():
                got.extend(out.new_token_ids)
        assert (got == whole[k:]) is expect_equal


def test_chunked_prefill_and_preemption_keep_processing(tiny_llama, hf_processed_greedy):
    # 8-token chunks split the prompts; a 12-block pool forces preemption by recompute mid-decode.
    llm = LLM(str(tiny_llama), num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    eos = set(llm.core.eos_token_ids)
    params = _greedy(
        presence_penalty=0.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        bad_words_token_ids=[[987]],
        min_tokens=3,
    )
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1][:9], PROMPTS[0][:6]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_processed_greedy(prompt, params, eos)


def test_seeded_sampling_with_penalties_is_reproducible_and_differs_from_without(llm):
    kw = dict(temperature=0.3, seed=7, max_tokens=MAX_TOKENS)
    a = llm.generate(PROMPTS, SamplingParams(frequency_penalty=2.0, **kw), use_tqdm=False)
    b = llm.generate(PROMPTS, SamplingParams(frequency_penalty=2.0, **kw), use_tqdm=False)
    c = llm.generate(PROMPTS, SamplingParams(**kw), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_adjustment_matches_reference_rule_on_random_logits():
    torch.manual_seed(0)
    vocab = 100
    rows = [
        RowHistory(
            SamplingParams(**CASES["all"], max_tokens=20), [1, 2, 3, 5, 77, 5, 9], 4, 4, frozenset({0})
        ),
        RowHistory(
            SamplingParams(repetition_penalty=0.5, max_tokens=20), [4, 4, 8, 1, 1, 1], 3, 3, frozenset()
        ),
        RowHistory(
            SamplingParams(bad_words_token_ids=[[8, 1], [3]], max_tokens=20), [2, 8], 0, 0, frozenset()
        ),
    ]
    logits = torch.randn(4, vocab) * 3
    adj = LogitsAdjustment.build([(0, rows[0]), (2, rows[1]), (3, rows[2])], torch.device("cpu"))
    got = adj.apply(logits)
    assert torch.equal(got[1], logits[1])  # the row without processing is untouched
    for i, row in ((0, rows[0]), (2, rows[1]), (3, rows[2])):
        prompt, out = row.token_ids[: row.output_start], row.output
        want = torch.tensor(
            reference_processed(logits[i].tolist(), prompt, out, row.params, set(row.eos_token_ids))
        )
        assert torch.allclose(got[i], want, atol=1e-5)


def test_frequency_penalty_counts_every_repeat_of_a_token():
    """A token the output holds three times is penalized three times the frequency penalty (and the
    presence penalty once); one never generated is untouched."""
    out = [6, 6, 6, 2]
    row = RowHistory(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, max_tokens=20),
        [9, 9, *out],
        2,
        2,
        frozenset(),
    )
    logits = torch.zeros(1, 10)
    got = LogitsAdjustment.build([(0, row)], torch.device("cpu")).apply(logits)[0]
    assert got[6].item() == pytest.approx(-3 * 0.5 - 0.25)
    assert got[2].item() == pytest.approx(-0.5 - 0.25)
    assert got[9].item() == 0.0  # in the prompt only: frequency and presence count the output
    assert torch.allclose(got, torch.tensor(reference_processed([0.0] * 10, [9, 9], out, row.params, set())))


def test_engine_refuses_ids_outside_the_vocabulary(llm):
    vocab = llm.core.spec.vocab_size
    for kw in (
        dict(logit_bias={vocab: 1.0}),
        dict(bad_words_token_ids=[[1, vocab]]),
        dict(stop_token_ids=[vocab + 3]),
    ):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.core.validate([1, 2], SamplingParams(**kw))
    with pytest.raises(ValueError, match="bad_words must be tokenized"):
        llm.core.validate([1, 2], SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match="prior_output_tokens"):
        llm.core.validate([1, 2], SamplingParams(prior_output_tokens=2))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    ],
)
def test_params_bounds(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def _as_kwargs(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


class _Words:
    """A tokenizer whose token i is the text WORDS[i] (decode joins them)."""

    WORDS = ("a", "b", "c", " stop", "d")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids)


@pytest.mark.parametrize(
    "min_tokens, tokens, stops_at",
    [
        (0, [0, 3, 1, 3], 2),  # the first " stop" ends it
        (2, [0, 3, 1, 3], 4),  # the first is inside the first two tokens: only the second counts
        (2, [0, 1, 3, 2], 3),  # ends in the third token's text
        (4, [3, 3, 3, 3, 3], 5),
    ],
)
def test_stop_strings_wait_for_min_tokens(min_tokens, tokens, stops_at):
    from engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(stop=[" stop"], min_tokens=min_tokens, max_tokens=8)
    detok = IncrementalDetokenizer(_Words(), [4], params)
    for i, tok in enumerate(tokens, 1):
        if detok.add([tok]) is not None:
            assert i == stops_at
            break
    else:
        raise AssertionError("no stop")
    # One call with every token finds the same first valid match.
    whole = IncrementalDetokenizer(_Words(), [4], params)
    assert whole.add(tokens[:stops_at]) == " stop" and whole.text == detok.text
