"""Bad input refused at the edge with the field named: every numeric field's range (the wire's int32
and float32 included), non-finite numbers, malformed JSON that used to escape as a 500, and prompts
longer than the context (by tokens, and by characters before tokenizing)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ingress.completion_batch import plan_completion
from ingress.model_info import load_model_info
from ingress.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from ingress.options import IngressOptions
from ingress.request_bounds import PROMPT_CHARS_PER_TOKEN, SEED_MAX, TOP_P_FLOOR
from ingress.request_validation import parse_body, validate_chat
from proto.convert import params_from_proto, params_to_proto

LIMITS = IngressOptions()
BIG = 2**31  # one past int32


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


def _refusal(fn) -> APIError:
    with pytest.raises(APIError) as exc:
        fn()
    assert exc.value.status == 400 and exc.value.body()["error"]["type"] == "invalid_request_error"
    return exc.value


def _completion(info, raw: bytes | None = None, limits=LIMITS, **body):
    raw = raw or json.dumps({"model": "tiny", "prompt": "the world", **body}).encode()
    plan = plan_completion(parse_body(raw, CompletionRequest), info, limits)
    return plan.parts[0]


def _chat(info, limits=LIMITS, **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return validate_chat(parse_body(json.dumps(body).encode(), ChatCompletionRequest), info, limits)


SHARED = [
    ("priority", BIG),
    ("priority", -BIG - 1),
    ("top_k", BIG),
    ("top_k", 10**30),
    ("top_k", -2),
    ("temperature", 1e308),  # finite in Python, inf as the wire's float32
    ("temperature", -0.5),
    ("top_p", 0),
    ("top_p", 1.5),
    ("min_p", -0.1),
    ("min_p", 2),
    ("seed", -1),
    ("seed", SEED_MAX + 1),
    ("seed", 2**64),
    ("n", 0),
    ("n", LIMITS.max_n + 1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0),
    ("repetition_penalty", 1e308),
    ("min_tokens", -1),
    ("min_tokens", 17),  # over max_tokens (16 for completions; 4 set for chat below)
    ("logit_bias", {"5": 101}),
    ("logit_bias", {"-3": 1}),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"99999999": 1}),  # outside the vocabulary
    ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("bad_words", ["  "]),
    ("bad_words", ["w"] * 65),
    ("stop", ["x" * 1025]),
    ("stop", ["s"] * 17),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**32]),
    ("stop_token_ids", [1] * 1025),
    ("max_tokens", 0),
    ("max_tokens", -(2**63)),
]


@pytest.mark.parametrize("field,value", SHARED)
def test_out_of_range_numbers_name_their_field_on_both_endpoints(info, field, value):
    assert _refusal(lambda: _completion(info, **{field: value})).param == field
    chat_extra = {"max_tokens": 4} if field != "max_tokens" else {}
    assert _refusal(lambda: _chat(info, **{field: value, **chat_extra})).param == field


@pytest.mark.parametrize(
    "field,value",
    [("logprobs", LIMITS.max_logprobs + 1), ("logprobs", -1), ("best_of", BIG), ("max_tokens", 2**40)],
)
def test_completion_only_fields(info, field, value):
    assert _refusal(lambda: _completion(info, **{field: value})).param == field


@pytest.mark.parametrize(
    "body,param",
    [
        ({"logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
    ],
)
def test_chat_only_fields(info, body, param):
    assert _refusal(lambda: _chat(info, **body)).param == param


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty"])
def test_non_finite_numbers_are_refused_with_the_field_named(info, field, literal):
    raw = b'{"model": "tiny", "prompt": "a", "%s": %s}' % (field.encode(), literal.encode())
    err = _refusal(lambda: _completion(info, raw))
    assert err.param == field and "finite" in err.message


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "prompt": "a", "priority": 1' + b"0" * 5000 + b"}",  # int over 4300 digits
        b"[" * 100_000,  # nesting deeper than the parser's recursion
    ],
)
def test_json_the_parser_chokes_on_is_a_400(raw):
    assert _refusal(lambda: parse_body(raw, CompletionRequest)).code == "invalid_json"


def test_sampling_controls_reach_the_engine_params(info):
    body = dict(
        presence_penalty=-2,
        frequency_penalty=1.5,
        repetition_penalty=1.2,
        logit_bias={"5": -100, "7": 3.5},
        min_tokens=3,
        bad_words=["the world", " is"],
    )
    for g in (_completion(info, prompt="a", **body), _chat(info, max_tokens=8, **body)):
        p = g.params
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2, 1.5, 1.2)
        assert p.logit_bias == {5: -100.0, 7: 3.5} and p.min_tokens == 3
        # The tokenizer's own encodings of each word (this word-level tokenizer ignores spaces).
        assert p.bad_words_token_ids == [info.tokenizer.encode("the world"), info.tokenizer.encode("is")]
    neutral = _completion(info, prompt="a").params
    assert not neutral.processes_logits


def test_bounds_that_are_accepted_survive_the_wire(info):
    """The edge values of each range make a proto that converts back to the same parameters."""
    g = _completion(info, priority=-(2**31), top_k=BIG - 1, temperature=1000.0, seed=SEED_MAX, top_p=1e-300)
    assert g.priority == -(2**31)
    back = params_from_proto(params_to_proto(g.params))
    assert (back.top_k, back.temperature, back.seed) == (BIG - 1, 1000.0, SEED_MAX)
    assert back.top_p == pytest.approx(TOP_P_FLOOR)  # not 0, which the wire reads as "off"
    assert _completion(info, priority=BIG - 1, top_k=-1).params.top_k == 0


def test_chat_prompt_over_the_context_without_max_tokens_names_the_messages(info):
    long = " ".join(["world"] * (info.max_model_len + 10))
    err = _refusal(lambda: _chat(info, messages=[{"role": "user", "content": long}]))
    assert err.param == "messages" and err.code == "context_length_exceeded"
    assert "max_tokens" not in err.message and str(info.max_model_len) in err.message
    for body in ({}, {"max_tokens": 5}):
        err = _refusal(lambda b=body: _completion(info, prompt=long, **b))
        assert err.param == "prompt" and err.code == "context_length_exceeded"
    err = _refusal(lambda: _completion(info, prompt=[1] * info.max_model_len))
    assert err.param == "prompt" and err.code == "context_length_exceeded"
    # Room in the context but max_tokens asks for more: that is the completion length's fault.
    err = _refusal(lambda: _completion(info, prompt="a", max_tokens=info.max_model_len))
    assert err.param == "max_tokens" and err.code == "context_length_exceeded"


class CountingTokenizer:
    """The real tokenizer, counting encode() calls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoded = 0

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_prompt_text_over_the_character_bound_is_refused_before_tokenizing(info):
    tok = CountingTokenizer(info.tokenizer)
    counted = replace(info, tokenizer=tok)
    limit = PROMPT_CHARS_PER_TOKEN * info.max_model_len  # the default bound
    err = _refusal(lambda: _completion(counted, prompt="a" * (limit + 1)))
    assert err.param == "prompt" and err.code == "context_length_exceeded"
    half = [{"role": "user", "content": "a" * (limit // 2 + 1)}]
    err = _refusal(lambda: _chat(counted, messages=half + half))  # the messages' text together
    assert err.param == "messages" and err.code == "context_length_exceeded"
    assert tok.encoded == 0
    # A configured bound replaces the default one.
    err = _refusal(
        lambda: _completion(counted, limits=IngressOptions(max_prompt_chars=8), prompt="the world is")
    )
    assert err.code == "context_length_exceeded" and tok.encoded == 0
    assert _completion(counted, prompt="the world").prompt_ids and tok.encoded == 1


def test_a_negative_logit_bias_key_is_named_plainly():
    from ingress.request_bounds import check_logit_bias

    with pytest.raises(APIError) as exc:
        check_logit_bias({"-1": 5})
    assert exc.value.message == "logit_bias key '-1' must be a token id (a non-negative integer)"
    with pytest.raises(APIError) as exc:
        check_logit_bias({"7": 5}, vocab_size=4)
    assert exc.value.message == "logit_bias key '7' must be a token id in [0, 4)"


def test_null_for_an_optional_field_is_its_default_and_a_required_ones_is_refused(info):
    """OpenAI's optional fields are all nullable, and SDKs send ``null``: each takes its default
    (``max_tokens``, whose ``None`` means up to the context, keeps it); ``null`` for a required field
    is a 400 naming it, and an unknown field, null or not, is an unsupported parameter."""
    nulls = {"n": None, "stream": None, "echo": None, "ignore_eos": None, "priority": None}
    plain = _completion(info)
    assert _completion(info, **nulls, stream_options=None) == plain
    chat_nulls = {"n": None, "stream": None, "logprobs": None, "add_generation_prompt": None}
    assert _chat(info, max_tokens=4, **chat_nulls) == _chat(info, max_tokens=4)
    assert not _chat(info, max_tokens=4, stream=True, stream_options={"include_usage": None}).include_usage
    assert _refusal(lambda: _completion(info, model=None)).param == "model"
    refused = _refusal(lambda: _completion(info, bogus=None)).body()["error"]
    assert (refused["param"], refused["code"]) == ("bogus", "unsupported_parameter")


def test_a_refusal_names_the_wrong_item_and_never_echoes_a_huge_value():
    """A 3 MB value of the wrong type is refused with its start shown, not sent back whole; a list of
    the wrong items names the item (``prompt.0``), not the union's string form; an image content part
    is an unsupported parameter naming what is supported."""
    huge = _refusal(
        lambda: parse_body(
            json.dumps({"model": "t", "prompt": {"x": "A" * 3_000_000}}).encode(), CompletionRequest
        )
    )
    assert huge.param == "prompt" and len(json.dumps(huge.body())) < 1000
    assert "must be a string or a list" in huge.message
    floats = _refusal(
        lambda: parse_body(json.dumps({"model": "t", "prompt": [1.5]}).encode(), CompletionRequest)
    )
    assert floats.param == "prompt.0" and floats.message.endswith("got 1.5")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "x" * 200_000}}
    body = {"model": "t", "messages": [{"role": "user", "content": [image]}]}
    part = _refusal(lambda: parse_body(json.dumps(body).encode(), ChatCompletionRequest))
    assert part.param == "messages.0.content.0.type" and part.code == "unsupported_parameter"
    assert part.message.endswith("'image_url'; supported: 'text'") and len(part.message) < 200


def test_a_tool_message_must_name_the_call_it_answers(info):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    msgs.append({"role": "tool", "content": "42"})
    err = _refusal(lambda: _chat(info, messages=msgs))
    assert err.param == "messages.2.tool_call_id" and err.code == "missing_field"
    msgs[2]["tool_call_id"] = "c1"
    assert _chat(info, messages=msgs).prompt_ids
