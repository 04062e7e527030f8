"""A completions request with several prompts: one admission slot for the whole request (so a
request with more prompts than slots cannot deadlock), a prompt's failure answered with its own
status, and a client that leaves mid-stream ending every prompt's generation and freeing the slot."""

from __future__ import annotations

import asyncio

import pytest
from asgi_client import call, finished, tokens

from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_protocol import APIError
from ingress.openai_serving import OpenAIServing
from ingress.options import IngressOptions


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


class ScriptedRouter:
    """Each Generate: the prompt's own script (by its first token id); counts open streams."""

    def __init__(self, scripts: dict[int, list]) -> None:
        self.scripts = scripts
        self.open = 0
        self.started = 0

    async def generate(self, rid, prompt, params, priority, timeout_s):
        self.open += 1
        self.started += 1
        try:
            for m in self.scripts[prompt[0]]:
                if m == "hang":
                    await asyncio.Event().wait()
                if isinstance(m, Exception):
                    raise m
                yield m
        finally:
            self.open -= 1


def _serving(info, router, **opts):
    serving = OpenAIServing(info, IngressOptions(**opts), router, IngressMetrics("tiny"))

    async def health():
        return True, {}

    async def render():
        return b""

    return serving, build_http_app(serving, None, health, render)


def test_more_prompts_than_admission_slots_stream_to_the_end(info):
    scripts = {p: [tokens([p]), tokens([p + 1]), finished()] for p in range(10, 15)}
    router = ScriptedRouter(scripts)
    serving, app = _serving(info, router, max_concurrent_requests=2)
    body = {"model": "tiny", "prompt": [[p] for p in scripts], "max_tokens": 2, "stream": True}
    r = asyncio.run(asyncio.wait_for(call(app, "/v1/completions", body), 30))
    assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n")
    indices = {c["index"] for e in r.events() for c in e.get("choices", [])}
    assert indices == {0, 1, 2, 3, 4}
    assert serving.admission.running == 0 and router.open == 0
    assert all("usage" not in e for e in r.events())  # only asked for, and then null until the end


def test_with_include_usage_every_chunk_of_several_prompts_says_usage_null_until_the_last(info):
    scripts = {p: [tokens([p]), tokens([p + 1]), finished()] for p in (10, 11)}
    _, app = _serving(info, ScriptedRouter(scripts))
    body = {"model": "tiny", "prompt": [[10], [11]], "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = asyncio.run(asyncio.wait_for(call(app, "/v1/completions", body), 30)).events()
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert len(events) > 2 and all("usage" in e and e["usage"] is None for e in events[:-1])


def test_a_failing_prompt_answers_with_its_status_and_closes_the_others(info):
    router = ScriptedRouter(
        {10: [tokens([10]), "hang"], 11: [APIError(400, "bad regex", code="invalid_request")]}
    )
    serving, app = _serving(info, router)
    for stream in (False, True):
        body = {"model": "tiny", "prompt": [[10], [11]], "max_tokens": 4, "stream": stream}
        r = asyncio.run(asyncio.wait_for(call(app, "/v1/completions", body), 30))
        assert r.status == 400 and r.json()["error"]["message"] == "bad regex"
        assert serving.admission.running == 0 and router.open == 0


def test_a_client_leaving_mid_stream_ends_every_prompt(info):
    router = ScriptedRouter({p: [tokens([p]), "hang"] for p in (10, 11, 12)})
    serving, app = _serving(info, router)

    async def main():
        body = {"model": "tiny", "prompt": [[10], [11], [12]], "max_tokens": 4, "stream": True, "echo": True}
        from asgi_client import Response

        out = Response()
        task = asyncio.create_task(call(app, "/v1/completions", body, out=out))
        await out.wait_for(lambda r: len(r.events()) >= 6)  # 3 echo chunks + a token of each prompt
        assert router.open == 3 and serving.admission.running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the cancelled generators' cleanup runs on the loop
            if router.open == 0 and serving.admission.running == 0:
                break
            await asyncio.sleep(0.01)
        assert router.open == 0 and serving.admission.running == 0

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_reach_the_answer(info, stream):
    """The workers' prompt logprobs (positions 1..) come back in vLLM's shape, the first None; in a
    stream with the first chunk."""
    from proto import pdserve_pb2 as pb

    first = tokens([7])
    first.tokens.prompt_logprobs.extend(
        [
            pb.TokenLogprobs(
                entries=[
                    pb.TokenLogprob(token_id=11, logprob=-1.5),
                    pb.TokenLogprob(token_id=3, logprob=-0.5),
                ]
            )
        ]
    )
    router = ScriptedRouter({10: [first, tokens([8]), finished()]})
    _, app = _serving(info, router)
    body = {"model": "tiny", "prompt": [10, 11], "max_tokens": 2, "prompt_logprobs": 1, "stream": stream}
    r = asyncio.run(call(app, "/v1/completions", body))
    choice = r.events()[0]["choices"][0] if stream else r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and set(plp[1]) == {"11", "3"} and plp[1]["11"]["logprob"] == -1.5
    assert plp[1]["3"]["decoded_token"] == info.tokenizer.decode([3])
