"""The offline API's edges a vLLM user meets (a review's findings, each reproduced first): bad
words given both ways, the earliest of several stop strings, a prompt's cache hit kept when a stop
string ends the output, an engine failure's reason on the output, a tiny temperature sampled
greedily, and ``LLM.chat`` given OpenAI's content parts and tool-call arguments."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput

P = "the quick brown fox jumps over the lazy dog; the world is wide."


@pytest.fixture(scope="module")
def llm(byte_level_model):
    return LLM(str(byte_level_model), num_blocks=64, block_size=4)


def _one(llm, prompt=P, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


def _free(llm) -> bool:
    return llm.stats().num_free_blocks == llm.stats().num_blocks


def _the(llm) -> dict[int, float]:
    """A bias that makes the model write "the" over and over (one token of the byte-level BPE)."""
    (the,) = llm.tokenizer.encode("the", add_special_tokens=False)
    return {the: 100.0}


def test_bad_words_and_bad_word_ids_are_both_banned(llm):
    forced = _one(llm, max_tokens=6, temperature=0, ignore_eos=True, logit_bias=_the(llm))
    assert forced.text == "the" * 6
    other = [llm.tokenizer.encode("zz", add_special_tokens=False)[:1]]
    out = _one(
        llm, max_tokens=6, temperature=0, ignore_eos=True, logit_bias=_the(llm), bad_words=["the"],
        bad_words_token_ids=other,
    )  # fmt: skip
    assert "the" not in out.text and other[0][0] not in out.token_ids
    assert _free(llm)


def test_of_several_stop_strings_the_first_in_the_text_ends_it(llm):
    out = _one(llm, max_tokens=4, temperature=0, ignore_eos=True, logit_bias=_the(llm), stop=["e", "h"])
    assert (out.text, out.stop_reason) == ("t", "h")


def test_a_stop_string_keeps_the_prompts_cache_hit(llm):
    _one(llm, max_tokens=2, temperature=0)  # the prompt's blocks are cached
    plain = _one(llm, max_tokens=4, temperature=0, ignore_eos=True, logit_bias=_the(llm))
    assert plain.num_cached_tokens > 0
    stopped = _one(llm, max_tokens=4, temperature=0, ignore_eos=True, logit_bias=_the(llm), stop=["het"])
    assert stopped.finish_reason == "stop" and stopped.num_cached_tokens == plain.num_cached_tokens


def test_an_engine_failure_says_why_on_the_output(llm):
    (ids,) = [[t] for t in llm.tokenizer.encode("a", add_special_tokens=False)]
    grammar = StructuredOutput("regex", "a")
    out = _one(llm, max_tokens=4, temperature=0, structured=grammar, bad_words_token_ids=[ids])
    assert out.outputs[0].finish_reason == "error"
    assert "grammar allows none" in out.outputs[0].error
    assert _free(llm)


def test_a_tiny_temperature_samples_greedily(llm):
    greedy = _one(llm, max_tokens=6, temperature=0, ignore_eos=True)
    assert _one(llm, max_tokens=6, temperature=1e-40, seed=1, ignore_eos=True).token_ids == greedy.token_ids
    assert (
        SamplingParams(temperature=1e-6).temperature == 0.0
        and SamplingParams(temperature=0.01).temperature == 0.01
    )


def test_chat_takes_content_parts_and_call_arguments_as_the_http_api_does(llm):
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %} call {{ c['function']['arguments'] | tojson }}{% endfor %}"
        " | {% endfor %}assistant:"
    )
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    turns = [*parts, {"role": "assistant", "content": None, "tool_calls": [call]}]
    (out,) = llm.chat(turns, SamplingParams(max_tokens=1), chat_template=template, use_tqdm=False)
    assert out.prompt == 'user: Hi there | assistant:  call {"x": 1} | assistant:'
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat(
            [{"role": "user", "content": [{"type": "image_url"}]}], chat_template=template, use_tqdm=False
        )
    assert _free(llm)
