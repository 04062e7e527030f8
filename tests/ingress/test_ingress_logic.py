"""The ingress's logic without Ray: validation, admission, stop strings while streaming, metrics, config.

The router stream here is a scripted list of protobuf messages (a fake of the router's output, for
the logic around it); the real path runs in tests/deploy/test_serve_api.py and test_serve_faults.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from deploy.config import PDServeConfig
from ingress.completion_batch import plan_completion
from ingress.generation import Generation
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from ingress.openai_serving import Admission, OpenAIServing
from ingress.options import IngressOptions
from ingress.request_validation import parse_body, validate_chat, validate_completion
from ingress.utility_routes import TokenizeRequest
from proto import pdserve_pb2 as pb
from proto.convert import stop_reason_fields
from router.migration import MigrationOptions


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


LIMITS = IngressOptions()


def _completion(info, **body):
    return validate_completion(CompletionRequest.model_validate({"model": "tiny", **body}), info, LIMITS)


def _plan(info, **body):
    return plan_completion(CompletionRequest.model_validate({"model": "tiny", **body}), info, LIMITS)


def test_completion_defaults_and_token_prompts(info):
    g = _completion(info, prompt="the world is")
    assert g.prompt_ids == info.tokenizer.encode("the world is")
    assert g.params.max_tokens == 16 and g.params.temperature == 1.0 and not g.stream
    g = _completion(info, prompt=[[3, 4, 5]], max_tokens=7, top_k=-1, stop="x", logprobs=2)
    assert g.prompt_ids == [3, 4, 5] and g.params.max_tokens == 7 and g.params.top_k == 0
    assert g.params.stop == ["x"] and g.logprobs == 2


def test_speculation_opt_out_crosses_the_wire(info):
    from proto.convert import params_from_proto, params_to_proto

    assert _completion(info, prompt="a").params.speculative is True
    off = _completion(info, prompt="a", speculative=False).params
    assert off.speculative is False
    assert params_from_proto(params_to_proto(off)).speculative is False
    assert params_from_proto(params_to_proto(_completion(info, prompt="a").params)).speculative is True


def test_chat_fills_the_context_by_default_and_maps_logprobs(info):
    req = ChatCompletionRequest.model_validate(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": True,
        }
    )
    g = validate_chat(req, info, LIMITS)
    assert g.params.max_tokens == info.max_model_len - len(g.prompt_ids)
    assert g.logprobs == 0 and g.chat


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "a", "min_p": 2}, 400, "min_p"),
        ({"prompt": "a", "seed": -1}, 400, "seed"),
        ({"prompt": "a", "top_k": -5}, 400, "top_k"),
        ({"prompt": "a", "stop": [""]}, 400, "stop"),
        ({"prompt": "a", "stop": ["s"] * 17}, 400, "stop"),
        ({"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ({"prompt": "a", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
        ({"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"prompt": "a", "suffix": "x"}, 400, "suffix"),
        ({"prompt": ["a"] * 65}, 400, "prompt"),
        ({"prompt": ["a", ""]}, 400, "prompt"),  # every prompt is validated
        ({"prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
        ({"prompt": "a", "best_of": 17}, 400, "best_of"),
        ({"prompt": "a", "best_of": 2, "stream": True}, 400, "best_of"),
        ({"prompt": "a", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ({"prompt": [1] * 600}, 400, "prompt"),  # the prompt alone fills the context
        ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),  # no stream
    ],
)
def test_completion_refusals(info, body, status, param):
    with pytest.raises(APIError) as exc:
        _plan(info, **body)
    assert exc.value.status == status and exc.value.param == param


def test_parse_body_errors():
    for raw, code in [(b"{", "invalid_json"), (b'"x"', "invalid_json"), (b"\xff\xfe", "invalid_json")]:
        with pytest.raises(APIError) as exc:
            parse_body(raw, CompletionRequest)
        assert exc.value.status == 400 and exc.value.code == code
    with pytest.raises(APIError) as exc:
        parse_body(b'{"model": "m", "prompt": "a", "temperature": "hot"}', CompletionRequest)
    assert exc.value.param == "temperature"
    assert exc.value.message == "invalid value for 'temperature': must be a number, got 'hot'"
    with pytest.raises(APIError) as exc:
        parse_body(b'{"model": "m", "prompt": "a", "max_tokens": "5"}', CompletionRequest)
    assert exc.value.message == "invalid value for 'max_tokens': must be an integer, got '5'"


@pytest.mark.parametrize(
    ("raw", "model_cls", "param"),
    [
        (b'{"model": "m", "prompt": "a\\ud800b"}', CompletionRequest, "prompt"),
        (b'{"model": "m", "prompt": "a", "stop": ["x", "\\udfff"]}', CompletionRequest, "stop.1"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud83d"}]}',
            ChatCompletionRequest,
            "messages.0.content",
        ),
        (b'{"prompt": "\\ud800"}', TokenizeRequest, "prompt"),
        (b'{"model": "m", "prompt": "a\\uDBFF"}', CompletionRequest, "prompt"),  # upper-case hex
        (b'{"model": "m", "prompt": "a\xed\xa0\x80"}', CompletionRequest, "prompt"),  # raw bytes, no escape
        (b'{"model": "m", "prompt": [5, 6, 7], "stop": ["\\ud800"]}', CompletionRequest, "stop.0"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(raw, model_cls, param):
    """JSON admits lone UTF-16 surrogates; no tokenizer can encode them (they were 500s)."""
    with pytest.raises(APIError) as exc:
        parse_body(raw, model_cls)
    assert exc.value.status == 400 and exc.value.param == param and "surrogate" in exc.value.message
    ok = parse_body(
        b'{"model": "m", "prompt": "fine \\ud83d\\ude00"}', CompletionRequest
    )  # a pair is a character
    assert ok.prompt == "fine \U0001f600"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user"}], "messages.0.content"),
        (
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}],
            "messages.1.content",
        ),
        ([{"role": "assistant"}], "messages.0.content"),  # no content and no tool calls
    ],
)
def test_a_chat_message_without_content_is_refused(info, messages, param):
    req = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages})
    with pytest.raises(APIError) as exc:
        validate_chat(req, info, LIMITS)
    assert exc.value.status == 400 and exc.value.param == param and "needs a content" in exc.value.message


def test_chat_stream_options_need_stream(info):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    req = ChatCompletionRequest.model_validate({**body, "stream_options": {"include_usage": True}})
    with pytest.raises(APIError) as exc:
        validate_chat(req, info, LIMITS)
    assert exc.value.param == "stream_options"
    validate_chat(
        ChatCompletionRequest.model_validate({**body, "stream": True, "stream_options": {}}), info, LIMITS
    )


def test_admission_queues_then_refuses_with_retry_after():
    async def main():
        adm = Admission(limit=2, queue=1)
        release = asyncio.Event()
        entered = []

        async def hold(i):
            async with adm.slot():
                entered.append(i)
                await release.wait()

        tasks = [asyncio.create_task(hold(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert entered == [0, 1] and adm.waiting == 1
        with pytest.raises(APIError) as exc:
            async with adm.slot():
                pass
        assert exc.value.status == 429 and int(exc.value.headers["Retry-After"]) >= 1
        release.set()
        await asyncio.gather(*tasks)
        assert entered == [0, 1, 2] and adm.running == 0 and adm.waiting == 0

    asyncio.run(main())


def test_a_slot_handed_to_a_waiter_that_leaves_goes_to_the_next_one():
    """The release wakes the first queued request, whose client leaves in the same instant: the
    next queued one gets the slot (it waited by a free slot, until another request came)."""

    async def main():
        adm = Admission(limit=1, queue=4)
        release, served = asyncio.Event(), []

        async def hold():
            async with adm.slot():
                await release.wait()

        async def queued(name):
            async with adm.slot():
                served.append(name)

        holder = asyncio.create_task(hold())
        while adm.running == 0:
            await asyncio.sleep(0)
        first, second = asyncio.create_task(queued("A")), asyncio.create_task(queued("B"))
        while adm.waiting < 2:
            await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0)  # the holder ran: released, its notify woke A, which has not run yet
        assert adm.running == 0 and holder.done() and not first.done()
        first.cancel()  # A's client went away in the same instant
        await asyncio.wait_for(second, timeout=10)
        assert served == ["B"] and adm.running == 0 and adm.waiting == 0
        assert first.cancelled()

    asyncio.run(main())


def test_admission_queue_defaults_to_twice_the_limit_and_retry_after_follows_the_drain_rate():
    adm = Admission(limit=4)
    assert adm.queue == 8 and IngressOptions().max_queued_requests is None
    adm.waiting = 9
    assert adm.retry_after_s(100.0) == 3  # nothing released yet: (9 + 1) / 4 slots, rounded up
    adm._released.extend(100.0 + 0.5 * i for i in range(11))  # two releases per second lately
    assert adm.drain_rate(105.0) == pytest.approx(2.0)
    assert adm.retry_after_s(105.0) == 5  # 10 ahead at 2 per second
    assert adm.retry_after_s(105.0 + Admission.RATE_HORIZON_S + 6) == 3  # old releases forgotten
    adm.waiting = 10_000
    assert adm.retry_after_s(105.0) == 60  # clamped


def test_a_client_that_leaves_while_queued_is_counted(info):
    async def main():
        metrics = IngressMetrics("tiny")
        serving = OpenAIServing(info, IngressOptions(max_concurrent_requests=1), None, metrics)
        held = await serving.admit()
        queued = asyncio.create_task(serving.admit())
        while serving.admission.waiting == 0:
            await asyncio.sleep(0.01)
        queued.cancel()  # the HTTP client went away before a slot freed
        with pytest.raises(asyncio.CancelledError):
            await queued
        await held.__aexit__(None, None, None)
        samples = {
            s.labels["status"]: s.value
            for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in fam.samples
            if s.name == "pdserve_requests_total"
        }
        assert samples.get("cancelled") == 1.0

    asyncio.run(main())


class ScriptedRouter:
    """Yields the given router messages; records whether the stream was closed early."""

    def __init__(self, messages):
        self.messages = messages
        self.closed_early = False

    async def generate(self, rid, prompt, params, priority, timeout_s):
        sent = 0
        try:
            for m in self.messages:
                sent += 1
                yield m
        finally:
            self.closed_early = sent < len(self.messages)


def _tokens(ids, index=0):
    return pb.GenerateResponse(tokens=pb.TokenChunk(sample_index=index, token_ids=ids))


def _finished(reason="length", index=0):
    return pb.GenerateResponse(
        finished=pb.Finished(sample_index=index, finish_reason=reason, usage=pb.Usage())
    )


def test_stop_string_is_held_back_while_streaming_and_ends_the_stream(info):
    tok = info.tokenizer
    ids = tok.encode("and more the world is in the")
    stop = tok.decode(ids[2:4])  # "the world": tokens 2 and 3
    g = _completion(info, prompt="a", stream=True, stop=[stop], max_tokens=20)
    router = ScriptedRouter([_tokens([t]) for t in ids] + [_finished()])
    gen = Generation("r1", g, tok, IngressMetrics("tiny"))

    async def run():
        return [d for deltas in [x async for x in gen.events(router, 5)] for d in deltas]

    deltas = asyncio.run(run())
    text = "".join(d.text for d in deltas)
    full = tok.decode(tok.encode("a") + ids)[len(tok.decode(tok.encode("a"))) :]
    assert text == full[: full.index(stop)] and stop not in text
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert router.closed_early  # the rest of the stream was cancelled (the worker aborts it)
    assert gen.usage.completion_tokens == 4  # generation ended at the token completing the stop string


def test_a_request_a_stop_string_ends_reports_its_prompts_cache_hit(info):
    """The prompt's cache hit rides on the first chunk: a stop string ends the request before the
    worker's Finished (which carried it alone), and usage still counts the cached tokens."""
    tok = info.tokenizer
    ids = tok.encode("and more the world is in the")
    stop = tok.decode(ids[2:4])
    first = _tokens(ids[:1])
    first.tokens.cached_tokens = 16
    finished = pb.GenerateResponse(
        finished=pb.Finished(finish_reason="length", usage=pb.Usage(cached_tokens=16))
    )
    router = ScriptedRouter([first] + [_tokens([t]) for t in ids[1:]] + [finished])
    gen = Generation(
        "r1", _completion(info, prompt="a", stop=[stop], max_tokens=20), tok, IngressMetrics("tiny")
    )

    async def run():
        return [d for deltas in [x async for x in gen.events(router, 5)] for d in deltas]

    assert asyncio.run(run())[-1].finish_reason == "stop" and router.closed_early
    assert gen.usage.cached_tokens == 16


@pytest.mark.parametrize("reason", [563, "\n\n", None])
def test_a_stop_tokens_id_reaches_the_client_as_a_number(info, reason):
    """``stop_reason`` as the engine gave it (vLLM's API): a stop token's id an int, a stop string a
    string, across the wire (``Finished`` carries the id as a number too)."""
    finished = pb.Finished(finish_reason="stop", usage=pb.Usage(), **stop_reason_fields(reason))
    router = ScriptedRouter([_tokens([5]), pb.GenerateResponse(finished=finished)])
    gen = Generation(
        "r1", _completion(info, prompt="a", max_tokens=4), info.tokenizer, IngressMetrics("tiny")
    )

    async def run():
        return [d for deltas in [x async for x in gen.events(router, 5)] for d in deltas]

    last = asyncio.run(run())[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", reason)
    assert type(last.stop_reason) is type(reason)


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_token_ends_the_text_without_its_own_and_counts_as_a_token(info, stream):
    """vLLM's rule: the token of ``stop_token_ids`` that ended a choice is in its tokens (usage,
    logprobs) but not in its text, streamed or not."""
    tok = info.tokenizer
    ids = tok.encode("the world is in a house")
    stop_id = ids[-1]
    assert stop_id not in ids[:-1]  # (the engine stops at the first)
    g = _completion(info, prompt="a", stream=stream, stop_token_ids=[stop_id], max_tokens=20, logprobs=1)

    def chunk(token_ids):
        lps = [pb.TokenLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=-1.0)]) for t in token_ids]
        return pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=token_ids, logprobs=lps))

    chunks = [chunk([t]) for t in ids[:-2]] + [chunk(ids[-2:])]  # the stop token with another
    finished = pb.Finished(finish_reason="stop", usage=pb.Usage(), **stop_reason_fields(stop_id))
    router = ScriptedRouter([*chunks, pb.GenerateResponse(finished=finished)])
    gen = Generation("r1", g, tok, IngressMetrics("tiny"))

    async def run():
        return [d for deltas in [x async for x in gen.events(router, 5)] for d in deltas]

    deltas = asyncio.run(run())
    text = "".join(d.text for d in deltas)
    prefix = tok.decode(tok.encode("a"))
    assert text == tok.decode(tok.encode("a") + ids[:-1])[len(prefix) :]
    assert gen.usage.completion_tokens == len(ids)
    tokens = [lp.token for d in deltas for lp in d.logprobs]
    assert len(tokens) == len(ids) and "".join(tokens) == text  # the stop token's entry adds no text
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop_id)


def test_worker_error_becomes_an_api_error(info):
    g = _completion(info, prompt="a", max_tokens=4)
    router = ScriptedRouter(
        [
            _tokens([5]),
            pb.GenerateResponse(error=pb.StreamError(code="kv_transfer_failed", message="pull failed")),
        ]
    )
    gen = Generation("r2", g, info.tokenizer, IngressMetrics("tiny"))

    async def run():
        async for _ in gen.events(router, 5):
            pass

    with pytest.raises(APIError) as exc:
        asyncio.run(run())
    assert exc.value.status == 503 and exc.value.code == "kv_transfer_failed"


def test_metrics_render_worker_and_transfer_series():
    m = IngressMetrics("tiny")
    m.observe_ttft(0.1)
    m.count("success")
    stats = pb.EngineStats(
        num_running=2,
        num_blocks=10,
        num_free_blocks=4,
        kv_usage=0.6,
        num_preemptions=3,
        prefix_cache_queries=96,
        prefix_cache_hits=32,
        spec_num_drafts=10,
        spec_draft_tokens=30,
        spec_accepted_tokens=12,
        spec_accepted_per_position=[7, 4, 1],
    )
    transfer = pb.KVTransferStats(
        descriptors=3,
        bytes=4096,
        streamed_bytes=1024,
        completed=2,
        seconds_sum=0.03,
        bucket_bounds=[0.01, 0.1],
        bucket_counts=[1, 1, 0],
    )
    workers = [
        pb.WorkerState(worker_id="decode-a", role="decode", stats=stats, transfer_stats=transfer),
        pb.WorkerState(
            worker_id="prefill-a", role="prefill", transfer_stats=pb.KVTransferStats(expired_leases=2)
        ),
    ]
    cluster = pb.ClusterState(
        requests_routed=5, migrations=2, stalls=1, migrations_refused=1, kv_streamed=4, peer_reads=6,
        failed_requests=3, failed_by_code={"UNAVAILABLE": 2, "INVALID_ARGUMENT": 1}, router_id="r1",
        prompt_tokens=640, delivered_hit_tokens=320, prefill_retries=7, aggregated_fallbacks=1,
        decode_retries=2, gaps_detected=3, resyncs=4, event_lag_seconds=0.25,
    )  # fmt: skip
    text = m.render(cluster, workers, ("ing-1", 1, 0)).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    R1 = (("router", "r1"),)  # every router series names the router replica that answered
    assert samples[("pdserve_requests_running", (("role", "decode"), ("worker", "decode-a")))] == 2
    assert samples[("pdserve_requests_running", (("role", "ingress"), ("worker", "ing-1")))] == 1
    # the fault path's counters, and the hit tokens a window's hit ratio is computed from
    assert samples[("pdserve_router_prefill_retries_total", R1)] == 7
    assert samples[("pdserve_router_aggregated_fallbacks_total", R1)] == 1
    assert samples[("pdserve_router_decode_retries_total", R1)] == 2
    assert samples[("pdserve_router_index_gaps_total", R1)] == 3
    assert samples[("pdserve_router_index_resyncs_total", R1)] == 4
    assert samples[("pdserve_router_event_lag_seconds", R1)] == 0.25
    assert samples[("pdserve_router_prompt_tokens_total", R1)] == 640
    assert samples[("pdserve_router_delivered_hit_tokens_total", R1)] == 320
    assert samples[("pdserve_preemptions_total", (("role", "decode"), ("worker", "decode-a")))] == 3
    assert samples[("pdserve_prefix_cache_queries_total", (("role", "decode"), ("worker", "decode-a")))] == 96
    assert samples[("pdserve_prefix_cache_hits_total", (("role", "decode"), ("worker", "decode-a")))] == 32
    ids = (("role", "decode"), ("worker", "decode-a"))
    assert samples[("pdserve_spec_decode_drafts_total", ids)] == 10
    assert samples[("pdserve_spec_decode_accepted_tokens_total", ids)] == 12
    assert samples[("pdserve_spec_decode_acceptance_ratio", ids)] == 0.4
    assert samples[("pdserve_spec_decode_mean_accepted_length", ids)] == 2.2
    assert samples[("pdserve_spec_decode_accepted_per_position_total", (("position", "1"), *ids))] == 4
    assert samples[("pdserve_kv_transfer_bytes_total", (("worker", "decode-a"),))] == 4096
    assert samples[("pdserve_kv_transfer_descriptors_total", (("worker", "decode-a"),))] == 3
    assert samples[("pdserve_kv_lease_expirations_total", (("worker", "prefill-a"),))] == 2
    assert samples[("pdserve_kv_transfer_streamed_bytes_total", (("worker", "decode-a"),))] == 1024
    assert samples[("pdserve_router_kv_streamed_total", R1)] == 4
    assert samples[("pdserve_router_peer_reads_total", R1)] == 6
    assert samples[("pdserve_kv_transfer_seconds_bucket", (("le", "0.1"), ("worker", "decode-a")))] == 2
    assert samples[("pdserve_kv_transfer_seconds_count", (("worker", "decode-a"),))] == 2
    assert (
        samples[
            ("pdserve_requests_total", (("frontend", "0"), ("model_name", "tiny"), ("status", "success")))
        ]
        == 1
    )
    assert samples[("pdserve_router_requests_routed_total", R1)] == 5
    assert samples[("pdserve_router_migrations_total", R1)] == 2
    assert samples[("pdserve_router_stalls_total", R1)] == 1
    assert samples[("pdserve_router_migrations_refused_total", R1)] == 1
    assert samples[("pdserve_router_failed_requests_total", (("code", "UNAVAILABLE"), *R1))] == 2
    assert samples[("pdserve_router_failed_requests_total", (("code", "INVALID_ARGUMENT"), *R1))] == 1


def test_config_validation():
    c = PDServeConfig(model="m", prefill={"num_replicas": 2, "resources": {"prefill_gpu": 1}})
    opts = c.prefill.deployment_options()
    assert opts["num_replicas"] == 2 and opts["ray_actor_options"]["resources"] == {"prefill_gpu": 1}
    routed = PDServeConfig(model="m", router={"max_migrations": 0, "stall_timeout_s": 2.0, "suspect_s": 9})
    assert routed.router.migration() == MigrationOptions(max_migrations=0, stall_timeout_s=2.0, suspect_s=9.0)
    assert PDServeConfig(model="m").router.migration() == MigrationOptions()
    auto = PDServeConfig(model="m", decode={"autoscaling": {"min_replicas": 1, "max_replicas": 3}})
    assert "num_replicas" not in auto.decode.deployment_options()
    for bad in (
        {"mode": "both"},
        {"decode": {"num_replicas": 0}},
        {"prefill": {"num_replicas": 0}},
        {"redis_url": "http://x"},
        {"engine": {"block_size": 0}},
        {"unknown": 1},
        {"decode": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}},
    ):
        with pytest.raises(ValidationError):
            PDServeConfig(model="m", **bad)
    assert PDServeConfig(model="m", mode="aggregated", prefill={"num_replicas": 0}).mode == "aggregated"


class RefusingRouter:
    """Refuses every request as a worker refuses a grammar it cannot compile."""

    def __init__(self, in_band: bool) -> None:
        self.in_band = in_band

    async def generate(self, rid, prompt, params, priority, timeout_s):
        message = "cannot compile the regex for structured output: Regex parsing error at position 4"
        if self.in_band:
            yield pb.GenerateResponse(error=pb.StreamError(code="invalid_argument", message=message))
        else:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message
            )


@pytest.mark.parametrize("in_band", [False, True])
@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"guided_regex": "a(b"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
        ),
    ],
)
def test_a_grammar_the_workers_cannot_compile_is_a_400_naming_its_field(info, in_band, field, param):
    g = _completion(info, prompt="a", **field)
    gen = Generation("r1", g, info.tokenizer, IngressMetrics("tiny"))

    async def main():
        async for _ in gen.events(RefusingRouter(in_band), 10):
            pass

    with pytest.raises(APIError) as exc:
        asyncio.run(main())
    assert exc.value.status == 400 and exc.value.param == param and "position 4" in exc.value.message


def test_inter_token_gaps_are_measured_within_each_sample(info, monkeypatch):
    """n=4: the four samples' tokens of a step come in four messages at once, a step (20 ms) after
    the last. Each gap is one sample's: 20 ms, never the 0 between two samples of one step."""
    import ingress.generation as generation

    now = [10.0]
    monkeypatch.setattr(generation.time, "perf_counter", lambda: now[0])

    class Recorded(IngressMetrics):
        def __init__(self, model: str) -> None:
            super().__init__(model)
            self.gaps: list = []

        def observe_token_gap(self, gap_s: float, n: int) -> None:
            self.gaps.append((round(gap_s, 6), n))

    class SteppedRouter(ScriptedRouter):
        async def generate(self, rid, prompt, params, priority, timeout_s):
            for step in range(5):
                now[0] += 0.02
                for j in range(4):
                    yield _tokens([5 + step], index=j)
            for j in range(4):
                yield _finished(index=j)

    g = _completion(info, prompt="a", n=4, seed=1, max_tokens=5)
    metrics = Recorded("tiny")
    gen = Generation("r1", g, info.tokenizer, metrics)

    async def run():
        return [x async for x in gen.events(SteppedRouter([]), 5)]

    asyncio.run(run())
    assert metrics.gaps == [(0.02, 1)] * 16  # 4 steps after each sample's first token, 4 samples
