"""Tool calling: tools reach the chat template, tool_choice becomes the right grammar, calls are read
from the answer into message.tool_calls (streamed as deltas), and "required" / named calls generated
under their grammar always carry arguments of the declared schema."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import pytest
from asgi_client import FedRouter, call, finished, tokens
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_protocol import APIError, ChatCompletionRequest
from ingress.openai_serving import OpenAIServing
from ingress.options import IngressOptions
from ingress.tool_calls import ToolPlan, ToolStream, parse_tool_calls, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }} {% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant:"
)


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], **kw}
    )


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [{"type": "code", "function": {"name": "x"}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (  # a parameters schema generation could not be held to
            {
                "tools": [{**TIME, "function": {"name": "t", "parameters": {"uniqueItems": True}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_name_their_field(kw, param):
    with pytest.raises(APIError) as exc:
        plan_tools(_req(**kw))
    assert exc.value.status == 400 and exc.value.param == param


def test_tool_choice_modes():
    tools, plan, grammar = plan_tools(_req(tools=[WEATHER, TIME]))
    assert tools == [WEATHER, TIME] and plan.mode == "auto" and grammar is None
    assert plan_tools(_req(tools=[WEATHER], tool_choice="none")) == (None, None, None)
    _, plan, grammar = plan_tools(
        _req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert (
        plan == ToolPlan("named", "get_weather")
        and json.loads(grammar.value) == WEATHER["function"]["parameters"]
    )
    _, plan, grammar = plan_tools(
        _req(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    )
    schema = json.loads(grammar.value)
    assert plan.mode == "required" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def test_auto_reads_hermes_blocks_and_leaves_other_text_alone():
    plan = ToolPlan("auto")
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(plan, text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls(plan, "no calls <tool_ here") == ("no calls <tool_ here", [])
    assert parse_tool_calls(plan, "<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_stream_holds_back_only_a_possible_marker():
    s = ToolStream(ToolPlan("auto"))
    sent = [
        s.feed(piece)
        for piece in ["Hello <", "to", "ol_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"]
    ]
    assert "".join(sent) == "Hello " and sent[0] == "Hello "
    rest, calls = s.finish("stop")
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    plain = ToolStream(ToolPlan("auto"))
    assert plain.feed("a < b <t") == "a < b " and plain.finish("stop") == ("<t", [])


@pytest.fixture(scope="module")
def info(byte_level_model):
    tok = AutoTokenizer.from_pretrained(byte_level_model)
    tok.chat_template = TOOLS_TEMPLATE
    base = load_model_info(str(byte_level_model), "tiny", None, tiny=True)
    return dataclasses.replace(base, tokenizer=tok)


class RecordingRouter(FedRouter):
    def __init__(self, script) -> None:
        super().__init__(script)
        self.calls = []

    async def generate(self, rid, prompt, params, priority, timeout_s):
        self.calls.append((list(prompt), params))
        async for m in super().generate(rid, prompt, params, priority, timeout_s):
            yield m


def _app(info, router):
    async def health():
        return True, {}

    async def render():
        return b""

    return build_http_app(
        OpenAIServing(info, IngressOptions(), router, IngressMetrics("tiny")), None, health, render
    )


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_come_back_as_tool_calls(info, stream):
    answer = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    ids = info.tokenizer.encode(answer, add_special_tokens=False)
    router = RecordingRouter([tokens(ids[:5]), tokens(ids[5:]), finished("stop")])
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [WEATHER],
        "stream": stream,
    }
    r = asyncio.run(call(_app(info, router), "/v1/chat/completions", body))
    prompt, params = router.calls[0]
    assert '"get_weather"' in info.tokenizer.decode(prompt)  # the template saw the tools
    assert params.structured is None  # auto: unconstrained
    if stream:
        choices = [e["choices"][0] for e in r.events() if e.get("choices")]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        calls = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
        reason = choices[-1]["finish_reason"]
    else:
        msg = r.json()["choices"][0]["message"]
        content, calls, reason = msg["content"], msg["tool_calls"], r.json()["choices"][0]["finish_reason"]
    assert content.strip() == "Sure."
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert reason == "tool_calls"


def test_named_and_required_calls_generated_under_their_grammar_follow_the_schema(byte_level_model):
    """The grammars plan_tools makes, run by the engine: every call parses, names a declared tool and
    carries arguments of its schema."""
    llm = LLM(str(byte_level_model), num_blocks=128, block_size=8)
    prompts = [list(range(10, 30)), [100, 7, 7, 250, 31, 31, 8, 90, 12, 13]]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        _, plan, grammar = plan_tools(
            _req(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        )
        params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=80, structured=grammar)
        for out in llm.generate(prompts, params, use_tqdm=False):
            for c in out.outputs:
                assert c.finish_reason == "stop", c.text
                content, calls = parse_tool_calls(plan, c.text)
                assert content is None and len(calls) == 1
                fn = calls[0]["function"]
                schema = next(
                    t["function"]["parameters"]
                    for t in (WEATHER, TIME)
                    if t["function"]["name"] == fn["name"]
                )
                jsonschema.validate(json.loads(fn["arguments"]), schema)


def test_calls_cut_by_max_tokens_are_text_and_auto_respects_parallel_false(info):
    answer = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call> done'
    ids = info.tokenizer.encode(answer, add_special_tokens=False)
    base = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}], "tools": [TIME]}
    for reason, parallel, want_calls in (("length", True, 0), ("stop", True, 2), ("stop", False, 1)):
        router = RecordingRouter([tokens(ids), finished(reason)])
        r = asyncio.run(
            call(_app(info, router), "/v1/chat/completions", {**base, "parallel_tool_calls": parallel})
        )
        choice = r.json()["choices"][0]
        assert len(choice["message"].get("tool_calls") or []) == want_calls
        assert choice["finish_reason"] == ("tool_calls" if want_calls else reason)
        if want_calls:
            assert choice["message"]["content"] == "done"  # the text after the calls stays


def test_required_tool_choice_refuses_min_tokens(info):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [TIME],
        "tool_choice": "required",
        "min_tokens": 2,
    }
    r = asyncio.run(call(_app(info, RecordingRouter([])), "/v1/chat/completions", body))
    assert r.status == 400 and r.json()["error"]["param"] == "min_tokens"


def test_a_forced_call_streams_no_chunk_while_it_is_held_back_and_no_content_beside_it(info):
    """A named tool_choice: the call's arguments come token by token but go out once, as the call;
    no empty content chunk per token meanwhile, and the call's delta has content null (OpenAI's)."""
    args = '{"city": "Paris", "days": 3}'
    ids = info.tokenizer.encode(args, add_special_tokens=False)
    router = RecordingRouter([tokens([i]) for i in ids] + [finished("stop")])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "stream": True}
    body |= {"tools": [WEATHER], "tool_choice": choice}
    events = asyncio.run(call(_app(info, router), "/v1/chat/completions", body)).events()
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert len(ids) > 5 and len(deltas) == 2  # the role, then the call
    assert deltas[0] == {"role": "assistant", "content": ""}
    (tool_call,) = deltas[1]["tool_calls"]
    assert deltas[1]["content"] is None and tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris", "days": 3}


TREE = {  # refers to itself ("#") and to its "definitions", as zod and Pydantic v1 write schemas
    "type": "function",
    "function": {
        "name": "tree",
        "parameters": {
            "type": "object",
            "definitions": {"u": {"enum": ["c", "f"]}},
            "properties": {
                "unit": {"$ref": "#/definitions/u"},
                "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}},
            },
            "required": ["unit", "kids"],
        },
    },
}


def test_required_calls_keep_a_tools_own_references_pointing_into_it():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from engine.structured_output import json_schema_grammar

    _, _, grammar = plan_tools(_req(tools=[TREE, TIME], tool_choice="required"))
    g = xgr.Grammar.from_ebnf(json_schema_grammar(grammar.value))
    nested = '[{"name": "tree", "parameters": {"unit": "c", "kids": [{"unit": "f", "kids": []}]}}]'
    assert _is_grammar_accept_string(g, nested)
    # "#" is the tool's parameters, not the array of calls; "u" its enum
    assert not _is_grammar_accept_string(g, '[{"name": "tree", "parameters": {"unit": "c", "kids": [[]]}}]')
    assert not _is_grammar_accept_string(g, '[{"name": "tree", "parameters": {"unit": "x", "kids": []}}]')


def test_arguments_are_the_models_own_text_and_a_cut_call_is_text():
    named = ToolPlan("named", "get_time")
    assert parse_tool_calls(named, '{"tz": 7') == ('{"tz": 7', [])  # a stop string cut it
    text = '[{"name": "f", "parameters": {"x": 36e945116, "y": 0.12345678901234567890123}}]'
    content, (call,) = parse_tool_calls(ToolPlan("required"), text)
    assert (
        content is None
        and call["function"]["arguments"] == '{"x": 36e945116, "y": 0.12345678901234567890123}'
    )
    auto = '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'
    assert parse_tool_calls(ToolPlan("auto"), auto)[1][0]["function"]["arguments"] == '{"x": 1e400}'


def test_streamed_content_is_the_whole_answers_with_text_after_the_calls():
    answer = 'Sure thing! <tool_call>{"name": "get_time", "arguments": {}}</tool_call> done'
    whole, calls = parse_tool_calls(ToolPlan("auto"), answer)
    stream = ToolStream(ToolPlan("auto"))
    sent = "".join(stream.feed(ch) for ch in answer)
    rest, streamed_calls = stream.finish("stop")
    assert sent + rest == whole == "Sure thing! done" and len(calls) == len(streamed_calls) == 1


def test_an_earlier_calls_arguments_reach_the_template_as_an_object():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": "time?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "t", "arguments": '{"tz": 3}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            ],
        }
    )
    (call,) = req.messages[1].for_template()["tool_calls"]
    assert call["function"]["arguments"] == {"tz": 3} and call["id"] == "c1"
