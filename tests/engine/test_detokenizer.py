"""The detokenizer's decode: the Rust tokenizer called directly gives what HF's ``decode`` gives
(special tokens skipped), falls back to ``decode`` where HF would change the text, and streamed
output adds up to what the tokens add to the prompt's decode."""

from __future__ import annotations

import functools
import random

import pytest
import transformers

from engine.detokenizer import IncrementalDetokenizer, text_decoder
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_llama))


def _samples(tokenizer, n: int = 200) -> list[list[int]]:
    rng = random.Random(0)
    special = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]
    assert special, "the tiny tokenizer has special tokens to skip"
    pool = list(range(len(tokenizer))) + special * 50
    return [[rng.choice(pool) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def test_the_direct_decode_matches_hf_decode_skipping_special_tokens(tokenizer):
    decode = text_decoder(tokenizer)
    assert isinstance(decode, functools.partial)  # the fast path is taken for this tokenizer
    for ids in _samples(tokenizer):
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tiny_llama):
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_llama), clean_up_tokenization_spaces=True)
    decode = text_decoder(tok)
    assert not isinstance(decode, functools.partial)
    for ids in _samples(tok, 50):
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_streamed_text_is_what_the_tokens_add_to_the_prompts_decode(tokenizer):
    prompt = [5, 6, 7]
    for ids in _samples(tokenizer, 50):
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(max_tokens=len(ids)))
        for tok in ids:
            detok.add([tok])
        detok.flush()
        whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
        assert detok.text == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]
