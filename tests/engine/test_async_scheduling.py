"""Overlapped scheduling (``async_scheduling``): step N+1 is scheduled and launched before step N's
tokens are read, and nothing a user sees changes: greedy output equals HF transformers, every
sampling mode equals the non-overlapped engine token for token, aborts and preemption free every
block. On CPU the device runs each op as it is issued, so these tests check the bookkeeping (the
placeholders, the one-step-behind outputs, the fallbacks), and a GPU run checks the speed."""

from __future__ import annotations

import random

import pytest
import torch

import engine.scheduler as scheduler_module
from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.structured_output import StructuredOutput


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


@pytest.fixture
def placeholders(monkeypatch):
    """How many tokens were scheduled before their value was known (0: nothing overlapped)."""
    count = [0]
    original = scheduler_module.Scheduler.expect_tokens

    def counting(self, seq_ids):
        count[0] += len(seq_ids)
        return original(self, seq_ids)

    monkeypatch.setattr(scheduler_module.Scheduler, "expect_tokens", counting)
    return count


def _run(model, prompts, params, **kw):
    llm = LLM(str(model), **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs], stats


@pytest.mark.parametrize("swap_space", [0.0, 0.01], ids=["recompute", "swap"])
def test_overlapped_greedy_matches_hf_through_chunks_prefix_hits_and_preemption(
    tiny_llama, hf_greedy, placeholders, swap_space
):
    prompts = _prompts(7, [20, 18, 22, 15, 19, 21, 17, 16])
    prompts += [[*prompts[0][:12], 5, 6, 7]]  # a prefix-cache hit
    llm = LLM(
        str(tiny_llama),
        async_scheduling="on",
        block_size=4,
        num_blocks=24,
        swap_space=swap_space,
        max_num_batched_tokens=32,
    )
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_llama, prompt, 24)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks
    assert placeholders[0] > 100


def test_every_sampling_mode_equals_the_engine_without_overlap(tiny_llama, placeholders):
    """Seeded sampling, stop tokens, logprobs, penalties, n > 1, prompt logprobs and a grammar in one
    batch: the steps that need host tokens fall back, the rest overlap, and nothing differs."""
    rng = random.Random(3)
    prompts = _prompts(5, [4, 9, 30, 12, 7, 16, 25, 3])
    params = [
        SamplingParams(
            temperature=0.9, seed=1, max_tokens=20, stop_token_ids=[rng.randrange(3, 1000) for _ in range(40)]
        ),
        SamplingParams(temperature=0, max_tokens=15, logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2, max_tokens=18),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=9, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutput("json_object")),
        SamplingParams(temperature=0.8, min_p=0.05, seed=4, max_tokens=22),
    ]
    kw = dict(block_size=4, num_blocks=64, max_num_batched_tokens=24)
    off, _ = _run(tiny_llama, prompts, params, async_scheduling="off", **kw)
    assert placeholders[0] == 0
    on, _ = _run(tiny_llama, prompts, params, async_scheduling="on", **kw)
    assert placeholders[0] > 20
    assert on == off


def test_speculative_decoding_steps_do_not_overlap_and_match(tiny_llama, placeholders):
    prompts = [[5, 6, 7, 8] * 6, _prompts(9, [14])[0]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    off, _ = _run(tiny_llama, prompts, params, async_scheduling="off", speculative_config=spec)
    on, _ = _run(tiny_llama, prompts, params, async_scheduling="on", speculative_config=spec)
    assert on == off and placeholders[0] == 0


def test_tokens_arrive_one_step_behind_and_a_stop_costs_one_dropped_token(tiny_llama):
    def stepped(mode: str):
        core = EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=32, async_scheduling=mode))
        core.add_request("r", [5, 9, 11, 40], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        per_step = []
        while core.has_unfinished():
            per_step.append([t for o in core.step() for t in o.new_token_ids])
        assert core.kv.num_free_blocks == core.kv.num_blocks
        return per_step

    off, on = stepped("off"), stepped("on")
    tokens = [t for s in off for t in s]
    assert off == [[t] for t in tokens]
    assert on == [[]] + [[t] for t in tokens]  # the first step's token comes with the second step


def test_a_stop_string_in_the_first_of_two_outputs_of_one_call_ends_the_output_there(tiny_llama, monkeypatch):
    """Overlapped, a step that must run synchronously (here a request with a penalty, admitted when
    a short one frees its seat) returns a running sequence's token in flight and its next one in
    one ``step`` call. When the first completes a stop string, ``LLM.generate`` ends the output
    there, as without overlap: the second is not appended (it was, text and token)."""
    a, c, b = [11, 22, 33, 44, 55], [66, 77, 88], [99, 111, 122, 133]
    kw = dict(block_size=4, num_blocks=64, max_num_seqs=2)

    def params(stop: list[str]) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop),
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, presence_penalty=0.5),
        ]

    calls: list[int] = []  # per step call, how many of the first request's tokens it returned
    step = EngineCore.step

    def counted(self, plain=None):
        outs = step(self, plain)
        calls.append(sum(len(o.new_token_ids) for o in outs if o.request_id == "offline-0"))
        return outs

    with monkeypatch.context() as m:
        m.setattr(EngineCore, "step", counted)
        llm = LLM(str(tiny_llama), async_scheduling="on", **kw)
        full = llm.generate([a, c, b], params([]), use_tqdm=False)[0].outputs[0].token_ids
    first_of_two = next(sum(calls[:i]) for i, n in enumerate(calls) if n >= 2)
    word = llm.tokenizer.decode([full[first_of_two]])
    assert word.strip() and word not in llm.tokenizer.decode(full[:first_of_two])
    got = {
        mode: LLM(str(tiny_llama), async_scheduling=mode, **kw).generate(
            [a, c, b], params([word]), use_tqdm=False
        )
        for mode in ("off", "on")
    }
    off, on = (got[mode][0].outputs[0] for mode in ("off", "on"))
    assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, off.finish_reason)
    assert off.finish_reason == "stop" and len(off.token_ids) == first_of_two + 1


def test_an_abort_with_a_token_in_flight_frees_everything(tiny_llama):
    prompts = _prompts(11, [6, 10, 14])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(mode: str, abort: bool):
        core = EngineCore(
            EngineConfig(model=str(tiny_llama), num_blocks=32, block_size=4, async_scheduling=mode)
        )
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
        steps = 0
        while core.has_unfinished():
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
            steps += 1
            if abort and steps == 4:
                assert core._inflight is None or "r1" in core._inflight[1].slots or mode == "off"
                core.abort_request("r1")
        assert core.kv.num_free_blocks == core.kv.num_blocks
        assert not core.scheduler.requests  # (the runner drops its states with the next schedule)
        return tokens

    ref = run("off", abort=False)
    got = run("on", abort=True)
    assert got["r0"] == ref["r0"] and got["r2"] == ref["r2"]
    assert len(got["r1"]) < 16 and got["r1"] == ref["r1"][: len(got["r1"])]


def test_async_scheduling_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=str(tiny_llama), async_scheduling="sometimes")
    assert not EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=8)).overlap  # off by default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real asynchronous copies)")
def test_on_a_gpu_overlapped_steps_equal_synchronous_ones(tiny_llama, placeholders):
    """Where the device really runs behind the host: CUDA graphs, pinned non-blocking copies and
    placeholders read on the device, float32, through chunked prefill, preemption and sampling."""
    prompts = _prompts(13, [3, 17, 40, 9, 28, 12, 33, 5, 21, 14, 7, 26])
    params = [
        SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=20 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    kw = dict(device="cuda", block_size=4, num_blocks=96, max_num_batched_tokens=48, max_num_seqs=8)
    off, _ = _run(tiny_llama, prompts, params, async_scheduling="off", **kw)
    on, _ = _run(tiny_llama, prompts, params, async_scheduling="on", **kw)
    assert on == off and placeholders[0] > 100


def test_a_steady_batch_resolved_in_bulk_then_a_synchronous_step_reads_real_tokens(tiny_llama):
    """A steady decode batch overlapped for many steps (its placeholders filled in bulk, as columns,
    on both sides), then requests that force synchronous steps (a penalty, then n-gram-like host
    reads): the runner's and the scheduler's token lists hold no placeholder behind the one in
    flight, and every output equals the engine without overlap."""
    from engine.request import PLACEHOLDER

    prompts = _prompts(11, [9, 14, 11, 7, 12, 10])
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    late = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=0.5)

    def run(overlap: str):
        core = EngineCore(
            EngineConfig(model=str(tiny_llama), async_scheduling=overlap, block_size=4, num_blocks=96)
        )
        out: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, plain)
        bulk = 0
        for k in range(400):
            if not core.has_unfinished():
                break
            if k == 14:
                core.add_request("late", [5, 6, 7], late)
            if overlap == "on" and k in (13, 16):  # steady before the late request, synchronous after
                seqs = core.runner.seqs
                for s in [s for s in seqs if s.startswith("r")]:
                    assert PLACEHOLDER not in seqs[s].token_ids[:-1]
                    req = core.scheduler.requests[s]
                    assert PLACEHOLDER not in req.token_ids[: len(req.token_ids) - req.num_placeholders]
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            inflight = core._inflight
            bulk += inflight is not None and inflight[1].placeholders is not None
        assert core.stats().num_free_blocks == 96
        return out, bulk

    expected, _ = run("off")
    got, bulk = run("on")
    assert got == expected
    assert bulk > 10  # steady steps overlapped with their placeholders resolved in bulk
