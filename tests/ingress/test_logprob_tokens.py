"""Logprob tokens that line up with the text: completions' ``tokens`` concatenate to the returned text
and ``text_offset`` indexes into it (across stream chunks too); chat's ``bytes`` are the token's
bytes; a token inside a character split over byte-level tokens reads ``bytes:\\x..`` and its bytes
list carries the raw bytes. Three tokenizer kinds: the tiny model's word-level one (a decoder that
joins words with spaces), a byte-level BPE (GPT-2 style) and a SentencePiece-style byte fallback."""

from __future__ import annotations

import asyncio

import pytest
from asgi_client import FedRouter, call, finished, tokens
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_serving import OpenAIServing
from ingress.options import IngressOptions
from ingress.token_text import TokenTexts
from proto import pdserve_pb2 as pb


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


def _logprobs(ids: list[int], k: int = 2) -> list[pb.TokenLogprobs]:
    """The sampled token first, then k alternatives (ids next to it), as a worker sends them."""
    return [
        pb.TokenLogprobs(
            entries=[pb.TokenLogprob(token_id=t, logprob=-0.5)]
            + [pb.TokenLogprob(token_id=t + j, logprob=-1.0 - j) for j in range(1, k + 1)]
        )
        for t in ids
    ]


def _app(info, script):
    metrics = IngressMetrics("tiny")
    serving = OpenAIServing(info, IngressOptions(), FedRouter(script), metrics)

    async def health():
        return True, {}

    async def render():
        return b""

    return build_http_app(serving, None, health, render)


def test_completion_tokens_concatenate_to_the_text_and_offsets_index_it(info):
    ids = info.tokenizer.encode("the world is in the world", add_special_tokens=False)
    script = [tokens(ids[:2], _logprobs(ids[:2])), tokens(ids[2:], _logprobs(ids[2:])), finished()]
    body = {"model": "tiny", "prompt": "a", "max_tokens": len(ids), "logprobs": 2}
    r = asyncio.run(call(_app(info, script), "/v1/completions", body)).json()["choices"][0]
    lp, text = r["logprobs"], r["text"]
    assert "".join(lp["tokens"]) == text and text.startswith(" ")  # the words' spaces kept
    assert [text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"])] == [True] * len(ids)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert all(tok in top and len(top) == 2 for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    # Streaming: offsets keep counting across chunks (into the whole text, not the chunk's).
    r = asyncio.run(call(_app(info, script), "/v1/completions", {**body, "stream": True}))
    chunks = [c["choices"][0] for c in r.events() if c["choices"] and c["choices"][0]["logprobs"]]
    streamed = [t for c in chunks for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert streamed == lp["tokens"] and offsets == lp["text_offset"]


def test_completion_top_logprobs_hold_the_sampled_token_chat_stays_at_k(info):
    """OpenAI's completions return the sampled token's logprob in ``top_logprobs`` too, "up to
    logprobs+1 elements" (``logprobs=0``: the sampled one alone); chat's ``top_logprobs`` are k."""
    ids = info.tokenizer.encode("the world is", add_special_tokens=False)
    # The sampled token third best: the worker sends it first, then the k best.
    worker = [
        pb.TokenLogprobs(
            entries=[pb.TokenLogprob(token_id=t, logprob=-5.0)]
            + [pb.TokenLogprob(token_id=t + j, logprob=-1.0 - j) for j in range(1, 3)]
        )
        for t in ids
    ]
    script = [tokens(ids, worker), finished()]
    for k, size in ((2, 3), (1, 2), (0, 1)):
        body = {"model": "tiny", "prompt": "a", "max_tokens": len(ids), "logprobs": k}
        for stream in (False, True):
            r = asyncio.run(call(_app(info, script), "/v1/completions", {**body, "stream": stream}))
            choices = [e["choices"][0] for e in r.events() if e["choices"]] if stream else r.json()["choices"]
            lps = [c["logprobs"] for c in choices if c["logprobs"] and c["logprobs"]["tokens"]]
            tops = [t for lp in lps for t in lp["top_logprobs"]]
            sampled = [t for lp in lps for t in lp["tokens"]]
            assert len(tops) == len(ids) and all(len(top) == size for top in tops), (k, stream, tops)
            assert all(top[tok] == -5.0 for tok, top in zip(sampled, tops))
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": len(ids),
    }
    content = asyncio.run(call(_app(info, script), "/v1/chat/completions", chat)).json()["choices"][0]
    assert all(len(c["top_logprobs"]) == 2 for c in content["logprobs"]["content"])
    assert all(
        c["token"] not in [a["token"] for a in c["top_logprobs"]] for c in content["logprobs"]["content"]
    )


def test_echo_of_a_token_prompt_reads_the_same_with_and_without_logprobs(info):
    """A special token in a token-id prompt: echoed as the output is decoded (skipped) either way;
    with logprobs, each prompt token's top_logprobs holds the token itself."""
    prompt = [info.tokenizer.bos_token_id, *info.tokenizer.encode("the world", add_special_tokens=False)]
    ids = info.tokenizer.encode("is", add_special_tokens=False)
    entries = [  # positions 1.. of the prompt, each token third best
        pb.TokenLogprobs(
            entries=[pb.TokenLogprob(token_id=t, logprob=-4.0)]
            + [pb.TokenLogprob(token_id=t + j, logprob=-1.0 - j) for j in (1, 2)]
        )
        for t in prompt[1:]
    ]
    first = pb.GenerateResponse(
        tokens=pb.TokenChunk(token_ids=ids, logprobs=_logprobs(ids), prompt_logprobs=entries)
    )
    body = {"model": "tiny", "prompt": prompt, "max_tokens": len(ids), "echo": True}
    plain = asyncio.run(call(_app(info, [first, finished()]), "/v1/completions", body)).json()["choices"][0]
    with_lp = asyncio.run(
        call(_app(info, [first, finished()]), "/v1/completions", {**body, "logprobs": 1})
    ).json()["choices"][0]
    assert (
        plain["text"] == with_lp["text"] == info.tokenizer.decode([*prompt, *ids], skip_special_tokens=True)
    )
    lp = with_lp["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for tok, v, top in zip(lp["tokens"][1 : len(prompt)], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert v == -4.0 and top[tok] == -4.0 and len(top) == 2


def test_chat_bytes_are_the_tokens_own_bytes(info):
    ids = info.tokenizer.encode("the world is", add_special_tokens=False)
    script = [tokens(ids, _logprobs(ids)), finished()]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": len(ids),
    }
    r = asyncio.run(call(_app(info, script), "/v1/chat/completions", body)).json()["choices"][0]
    content = r["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == r["message"]["content"]
    assert all(bytes(c["bytes"]) == c["token"].encode() for c in content)
    alts = [a for c in content for a in c["top_logprobs"]]
    assert all(bytes(a["bytes"]) == a["token"].encode() for a in alts)
    # After the first word, an alternative reads as it would in the text: with its space.
    assert all(a["token"].startswith(" ") for c in content[1:] for a in c["top_logprobs"])


def _byte_level_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    tok.train_from_iterator(["hello world the world is " * 50], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def _sentencepiece_tokenizer():
    vocab = [("<unk>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [("\u2581hello", -1.0), ("\u2581world", -1.0), ("\u2581", -2.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _read(tok, prompt: str, text: str, chunk: int):
    """The sampled tokens' (string, bytes) and the detokenized text, fed ``chunk`` tokens at a time."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), SamplingParams())
    texts, out, split = TokenTexts(tok), [], False
    for i in range(0, len(ids), chunk):
        detok.add(ids[i : i + chunk])
        out += texts.sampled(ids[i : i + chunk], detok.pieces, split)
        split = detok.pieces[-1] is None
    return out, detok.text


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer])
@pytest.mark.parametrize("chunk", [1, 3])
def test_a_character_split_over_tokens_reads_as_bytes(make, chunk):
    tok = make()
    read, text = _read(tok, "hello", " hello é world \U0001f600 hello", chunk)
    assert text == " hello é world \U0001f600 hello"
    assert b"".join(raw for _, raw in read) == text.encode()  # the bytes lists carry every byte
    split = [s for s, raw in read if s.startswith("bytes:")]
    assert split and all(eval(f'b"{s[len("bytes:") :]}"') in text.encode() for s in split)
    whole = [s for s, _ in read if not s.startswith("bytes:")]
    assert "".join(whole) == text.replace("é", "").replace("\U0001f600", "")  # the rest is the text


def test_alternatives_read_as_they_would_in_the_text():
    for tok in (_byte_level_tokenizer(), _sentencepiece_tokenizer()):
        texts = TokenTexts(tok)
        world = tok.encode(" world", add_special_tokens=False)
        assert texts.alternative(tok.encode("hello", add_special_tokens=False), world[0])[0].startswith(" w")


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer])
@pytest.mark.parametrize("stream", [False, True])
def test_an_output_ending_inside_a_character_keeps_its_last_bytes(info, make, stream):
    """Generation that stops (here: max_tokens) between the bytes of one character: the returned
    text is the tokenizer's decode of every returned token (after the prompt), the partial
    character included."""
    import dataclasses

    tok = make()
    prompt = tok.encode("hello", add_special_tokens=False)
    ids = tok.encode(" hello \U0001f600", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    expected = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert expected.endswith("\ufffd")
    byte_info = dataclasses.replace(info, tokenizer=tok, vocab_size=len(tok))
    script = [tokens(ids[:2]), tokens(ids[2:]), finished()]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": len(ids), "stream": stream}
    r = asyncio.run(call(_app(byte_info, script), "/v1/completions", body))
    if stream:
        text = "".join(e["choices"][0]["text"] for e in r.events() if e.get("choices"))
    else:
        text = r.json()["choices"][0]["text"]
    assert text == expected
    # The offline engine's detokenizer agrees.
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.add(ids)
    assert detok.text + detok.flush() == expected == detok.text
