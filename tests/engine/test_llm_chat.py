"""``LLM.chat`` (vLLM's offline chat): a conversation rendered by the model's chat template into the
prompt HF's own ``apply_chat_template`` tokenizes, and its greedy continuation HF transformers'; many
conversations at once; a last assistant message continued; refusals in one line."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the world"}]
OTHER = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), block_size=8, num_blocks=64)


def test_a_conversation_is_rendered_as_hf_renders_it_and_continued_as_hf_does(llm, tiny_llama, hf_greedy):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False)
    want = list(tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert out.prompt_token_ids == want
    assert out.prompt == tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, want, 6)
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_many_conversations_and_a_continued_last_message(llm, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    outs = llm.chat([HELLO, OTHER], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in (HELLO, OTHER)
    ]
    started = [*OTHER, {"role": "assistant", "content": "return"}]
    (cont,) = llm.chat(started, GREEDY, continue_final_message=True, use_tqdm=False)
    want = tok.apply_chat_template(started, continue_final_message=True, tokenize=False)
    assert cont.prompt == want and cont.prompt.rstrip().endswith("return")


def test_bad_conversations_are_refused_in_a_line(llm):
    with pytest.raises(ValueError, match="a conversation"):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="a conversation"):
        llm.chat([HELLO, []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template failed"):
        llm.chat(
            [{"role": "assistant", "content": "x"}],
            GREEDY,
            continue_final_message=True,
            chat_template="{{ raise_exception('no') }}",
            use_tqdm=False,
        )
    assert llm.stats().num_free_blocks == llm.stats().num_blocks
