"""vLLM's utility endpoints over ASGI: ``/tokenize`` equals the tokenizer's own encoding (text and chat
template), ``/detokenize`` inverts it, ``/version`` is the installed package's; bad bodies are 4xx
naming the field, the API key guards all three, and none of them touches the router."""

from __future__ import annotations

import asyncio
import copy
import importlib.metadata
import threading
from dataclasses import replace

import pytest
from asgi_client import call
from tokenizers import processors

from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_serving import INLINE_BODY_BYTES, OpenAIServing
from ingress.options import IngressOptions

CHAT = [{"role": "system", "content": "the world"}, {"role": "user", "content": "is the world"}]


class NoRouter:
    """A router that fails the test if anything asks it for anything."""

    def __getattr__(self, name):
        raise AssertionError(f"the router was used: {name}")


@pytest.fixture(scope="module")
def info(tiny_llama):
    """The tiny model, its tokenizer made to add a BOS token, so add_special_tokens shows."""
    info = load_model_info(str(tiny_llama), "tiny", None, tiny=True)
    tok = copy.deepcopy(info.tokenizer)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
    )
    return replace(info, tokenizer=tok)


def _app(info, api_key=None, options=None):
    serving = OpenAIServing(info, options or IngressOptions(), NoRouter(), IngressMetrics("tiny"))

    async def health():
        return True, {"status": "ok"}

    async def render():
        return b""

    return build_http_app(serving, api_key, health, render)


def _post(info, path, body, **kw):
    return asyncio.run(call(_app(info, **kw), path, body))


@pytest.mark.parametrize("special", [True, False, None])
def test_tokenize_text_equals_the_tokenizers_encode(info, special):
    body = {"model": "tiny", "prompt": "the world is"}
    if special is not None:
        body["add_special_tokens"] = special
    r = _post(info, "/tokenize", body)
    want = info.tokenizer.encode("the world is", add_special_tokens=special is not False)
    assert r.status == 200, r.json()
    assert r.json() == {
        "count": len(want),
        "max_model_len": info.max_model_len,
        "tokens": want,
        "token_strs": None,
    }
    assert (want[0] == info.tokenizer.bos_token_id) == (special is not False)


@pytest.mark.parametrize("generation", [True, False])
def test_tokenize_chat_equals_the_rendered_template_encoded(info, generation):
    tok = info.tokenizer
    text = tok.apply_chat_template(CHAT, add_generation_prompt=generation, tokenize=False)
    r = _post(info, "/tokenize", {"model": "tiny", "messages": CHAT, "add_generation_prompt": generation})
    want = tok.encode(text, add_special_tokens=False)
    assert r.status == 200 and r.json()["tokens"] == want and r.json()["count"] == len(want)
    r = _post(
        info, "/tokenize", {"messages": CHAT, "add_generation_prompt": generation, "add_special_tokens": True}
    )
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=True)


def test_tokenize_returns_token_strings_when_asked(info):
    r = _post(info, "/tokenize", {"model": "tiny", "prompt": "the world", "return_token_strs": True})
    body = r.json()
    assert (
        body["token_strs"] == info.tokenizer.convert_ids_to_tokens(body["tokens"]) == ["<s>", "the", "world"]
    )


def test_detokenize_inverts_tokenize(info):
    async def run():
        app = _app(info)
        body = {"model": "tiny", "prompt": "the world is", "add_special_tokens": False}
        ids = (await call(app, "/tokenize", body)).json()["tokens"]
        r = await call(app, "/detokenize", {"model": "tiny", "tokens": ids})
        assert r.status == 200 and r.json() == {"prompt": "the world is"}

    asyncio.run(run())


@pytest.mark.parametrize("bad", [-1, "vocab", 2**70])
def test_detokenize_refuses_ids_outside_the_vocabulary_naming_tokens(info, bad):
    bad = info.vocab_size if bad == "vocab" else bad
    r = _post(info, "/detokenize", {"model": "tiny", "tokens": [3, bad]})
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "tokens" and err["code"] == "invalid_token_id", err


@pytest.mark.parametrize(
    "path,body",
    [
        ("/tokenize", {"model": "big", "prompt": "the world"}),
        ("/tokenize", {"model": "big", "messages": CHAT}),
        ("/detokenize", {"model": "big", "tokens": [3]}),
    ],
)
def test_an_unknown_model_is_404(info, path, body):
    r = _post(info, path, body)
    err = r.json()["error"]
    assert r.status == 404 and err["param"] == "model" and err["code"] == "model_not_found", err


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/tokenize",
            {"model": "tiny", "prompt": "hi", "truncate_prompt_tokens": 3},
            "truncate_prompt_tokens",
        ),
        ("/tokenize", {"model": "tiny", "messages": CHAT, "chat_template": "x"}, "chat_template"),
        ("/detokenize", {"model": "tiny", "tokens": [3], "skip_special_tokens": True}, "skip_special_tokens"),
        ("/tokenize", {"model": "tiny", "prompt": 5}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"model": "tiny", "tokens": ["3"]}, "tokens.0"),
        ("/tokenize", {"model": "tiny"}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "hi", "messages": CHAT}, "messages"),
        (
            "/tokenize",
            {"model": "tiny", "prompt": "hi", "add_generation_prompt": True},
            "add_generation_prompt",
        ),
    ],
)
def test_bad_fields_are_400s_naming_the_field(info, path, body, param):
    r = _post(info, path, body)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == param, err


def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(info):
    options = IngressOptions(max_prompt_chars=100)
    r = _post(info, "/tokenize", {"model": "tiny", "prompt": "the " * 30}, options=options)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
    r = _post(info, "/tokenize", {"messages": [{"role": "user", "content": "the " * 30}]}, options=options)
    assert r.status == 400 and r.json()["error"]["param"] == "messages"


def test_a_large_body_is_tokenized_off_the_event_loop(info):
    threads: list[threading.Thread] = []

    class Recording:
        def encode(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return info.tokenizer.encode(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(info.tokenizer, name)

    app = _app(replace(info, tokenizer=Recording()))
    big = "the world " * (INLINE_BODY_BYTES // 8)
    for prompt in ("the world", big):
        r = asyncio.run(call(app, "/tokenize", {"model": "tiny", "prompt": prompt}))
        assert r.status == 200
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_version_is_the_installed_packages(info):
    r = asyncio.run(call(_app(info), "/version"))
    assert r.status == 200 and r.json() == {"version": importlib.metadata.version("pdserve")}


def test_the_utility_routes_need_the_key_when_one_is_configured(info):
    async def run():
        app = _app(info, api_key="sesame")
        requests = [
            ("/tokenize", {"model": "tiny", "prompt": "the world"}),
            ("/detokenize", {"model": "tiny", "tokens": [3]}),
            ("/version", None),
        ]
        for path, body in requests:
            r = await call(app, path, body)
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert (await call(app, path, body, headers={"Authorization": "Bearer wrong"})).status == 401
            assert (await call(app, path, body, headers={"Authorization": "Bearer sesame"})).status == 200
        open_app = _app(info)  # no key configured: open
        assert all([(await call(open_app, path, body)).status == 200 for path, body in requests])
        doc = (await call(app, "/openapi.json", headers={"Authorization": "Bearer sesame"})).json()
        assert {"/tokenize", "/detokenize", "/version"} <= set(doc["paths"])
        schemas = {
            path: doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path in ("/tokenize", "/detokenize")
        }
        assert {"prompt", "messages", "return_token_strs"} <= set(schemas["/tokenize"]["properties"])
        assert schemas["/detokenize"]["required"] == ["tokens"]
        assert "ChatMessage" in doc["components"]["schemas"]  # what the body's messages refer to

    asyncio.run(run())
