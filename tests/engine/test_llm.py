"""The offline API as a user sees it: outputs, stop conditions, logprobs, errors, and block accounting."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, EngineConfig, EngineCore, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), block_size=8, num_blocks=96, max_model_len=256)


def _all_free(llm: LLM) -> bool:
    s = llm.stats()
    return s.num_free_blocks == s.num_blocks and s.num_running == 0 and s.num_waiting == 0


def test_text_prompts_are_tokenized_and_outputs_detokenized(llm):
    out = llm.generate(
        "the world is", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.prompt == "the world is"
    assert out.prompt_token_ids == llm.tokenizer.encode("the world is")
    assert len(out.token_ids) == 6
    assert out.text.strip() == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
    assert _all_free(llm)


def test_stop_token_ids_and_max_tokens_set_finish_reason(llm):
    first = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    stop_tok = first.token_ids[3]
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_tok
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop_tok) + 1]
    # The stop token ends the output without its text (vLLM's rule), unless asked for.
    dec = functools.partial(llm.tokenizer.decode, skip_special_tokens=True)
    assert out.text == dec([5, 6, 7, *out.token_ids[:-1]])[len(dec([5, 6, 7])) :]
    kept = llm.generate(
        [[5, 6, 7]],
        SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[stop_tok], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0]
    assert kept.text == dec([5, 6, 7, *out.token_ids])[len(dec([5, 6, 7])) :] and kept.text != out.text
    assert first.finish_reason == "length"
    assert _all_free(llm)


def test_eos_stops_unless_ignored(tiny_model_factory):
    # A model whose EOS is the token it greedily emits first.
    probe_dir = tiny_model_factory("llama")
    probe = LLM(str(probe_dir), num_blocks=32)
    first = probe.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[
        0
    ].token_ids[0]
    model_dir = tiny_model_factory("llama", eos_token_id=first)
    llm = LLM(str(model_dir), num_blocks=32)
    stopped = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    ignored = llm.generate(
        [[9, 10, 11]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(ignored.token_ids) == 5 and ignored.finish_reason == "length"


def test_stop_string_cuts_text_and_frees_blocks(llm):
    base = llm.generate(
        "there was a man", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    words = base.text.split()
    stop = words[2]
    out = llm.generate(
        "there was a man",
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert stop not in out.text
    assert base.text.startswith(out.text)
    assert len(out.token_ids) < 10
    assert _all_free(llm)


def test_logprobs_match_reference_log_softmax(llm, tiny_llama):
    import transformers

    prompt = [11, 12, 13, 14]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5), use_tqdm=False
    )[0]
    assert len(out.logprobs) == 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
    first = out.logprobs[0]
    assert next(iter(first)) == out.token_ids[0]  # sampled token first
    assert len(first) == 5  # greedy token is also the top-1, so 5 distinct entries
    for tok, lp in first.items():
        assert lp == pytest.approx(ref[tok].item(), abs=1e-4)


def test_never_fitting_requests_fail_at_once(llm):
    with pytest.raises(ValueError, match="exceeds the model's context length of 256"):
        llm.generate([[1] * 200], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 5000]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], SamplingParams(max_tokens=1), use_tqdm=False)
    # A bad request in a batch refuses the whole batch before anything is queued.
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [1] * 300], SamplingParams(max_tokens=4), use_tqdm=False)
    assert _all_free(llm)


def test_request_larger_than_pool_fails_instead_of_hanging(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="needs 9 KV blocks but the whole pool has 8"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=5), use_tqdm=False)


def test_a_stop_string_completed_by_the_last_token_allowed_ends_with_stop(tiny_llama):
    """The token that reaches ``max_tokens`` also completes a stop string: the output ends at the
    string with finish reason ``stop`` (as the served path reports it), not ``length``."""
    llm = LLM(str(tiny_llama), block_size=4, num_blocks=64)
    prompt = [5, 9, 11, 40, 77]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    k = next(i for i in range(3, 12) if llm.tokenizer.decode([full.token_ids[i]]).strip()
             and llm.tokenizer.decode([full.token_ids[i]]) not in llm.tokenizer.decode(full.token_ids[:i]))  # fmt: skip
    word = llm.tokenizer.decode([full.token_ids[k]])
    params = SamplingParams(temperature=0, max_tokens=k + 1, stop=[word])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", word)
    assert out.token_ids == full.token_ids[: k + 1] and word not in out.text
    assert _all_free(llm)


@pytest.mark.parametrize("end", ["abort", "error"])
def test_ending_a_request_before_its_samples_fork_ends_every_sample(tiny_llama, end):
    """n = 3, ended mid-prefill (before the first token, where the samples fork): a finish for each
    of the three samples (a caller waiting on sample 2 learns it ended), every block free."""
    core = EngineCore(
        EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=64, max_num_batched_tokens=16)
    )
    core.add_request("r", list(range(3, 60)), SamplingParams(temperature=0, n=3, max_tokens=5))
    core.step()  # the first chunk of the prompt
    outs = core.abort_request("r") if end == "abort" else core.fail_request("r", "boom")
    assert sorted((o.sample_index, o.finish_reason) for o in outs) == [(i, end) for i in range(3)]
    assert not core.has_unfinished() and core.stats().num_free_blocks == 64


def test_abort_and_interrupted_generate_free_every_block(tiny_llama):
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=64))
    core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True, n=3))
    for _ in range(4):
        core.step()
    assert core.stats().num_free_blocks < 64
    outs = core.abort_request("b") + core.abort_request("a")
    assert {o.finish_reason for o in outs} == {"abort"}
    assert len(outs) == 4  # a, and the three samples of b
    assert not core.has_unfinished()
    assert core.stats().num_free_blocks == 64
    core.step()  # the runner drops the aborted sequences' state

    class Boom(Exception):
        pass

    llm = LLM(str(tiny_llama), block_size=4, num_blocks=64)
    calls = 0
    real_step = llm.core.step

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Boom()
        return real_step()

    llm.core.step = failing_step
    with pytest.raises(Boom):
        llm.generate([[5] * 10, [6] * 12], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.stats().num_free_blocks == 64 and not llm.core.has_unfinished()


def test_duplicate_request_id_is_refused(tiny_llama):
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=16))
    core.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    core.abort_request("x")


def test_an_id_a_parallel_sample_has_or_will_have_is_refused(tiny_llama):
    """``a`` with n = 2 forks ``a#1``: a request named ``a#1`` (forked or not yet) is refused, and so
    is ``b`` with n = 2 while a request ``b#1`` runs; either took over the other's scheduler entry and
    KV table (a stream that never ended, tokens from another's KV)."""
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=32))
    two = SamplingParams(max_tokens=3, n=2, ignore_eos=True)
    one = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request("a", [1, 2, 3], two)
    with pytest.raises(ValueError, match="'a#1' is already in use"):
        core.add_request("a#1", [4, 5], one)  # before the fork
    first = core.step()  # the prompt: forked now
    assert "a#1" in core.scheduler.requests
    with pytest.raises(ValueError, match="'a#1' is already in use"):
        core.add_request("a#1", [4, 5], one)
    core.add_request("b#1", [4, 5], one)
    with pytest.raises(ValueError, match="'b' is already in use"):
        core.add_request("b", [6, 7], two)
    core.add_request("c", [6, 7], one)  # n = 1 forks nothing: free while b#1 runs
    made, finished, outs = {}, set(), first
    while outs or core.has_unfinished():
        for o in outs:
            key = (o.request_id, o.sample_index)
            made[key] = made.get(key, 0) + len(o.new_token_ids)
            if o.finished:
                finished.add(key)
        outs = core.step() if core.has_unfinished() else []
    assert made == {("a", 0): 3, ("a", 1): 3, ("b#1", 0): 3, ("c", 0): 3} and finished == set(made)
    assert core.stats().num_free_blocks == 32


def test_model_step_failure_fails_requests_not_engine(tiny_llama):
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=16))
    core.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4))
    real = core.runner.launch  # what the engine calls each step
    core.runner.launch = lambda sched, overlap=False: (_ for _ in ()).throw(RuntimeError("device lost"))
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", "error")]
    assert "device lost" in outs[0].error
    core.runner.launch = real
    assert core.stats().num_free_blocks == 16
    core.add_request("y", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    assert core.stats().generation_tokens == 2


def test_a_failed_step_leaves_nothing_it_did_not_write_in_the_prefix_cache(tiny_llama):
    """Blocks are registered as cached when allocated (a prompt's) or when a decode fills them, before
    the step writes them. A step that fails takes them out again: the same prompt retried, or one that
    runs on into a block a failed decode step was filling, recomputes them (it hit garbage KV)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def generate(core, rid, prompt, p=params):
        core.add_request(rid, prompt, p)
        out = []
        while core.has_unfinished():
            out += [t for o in core.step() if o.request_id == rid for t in o.new_token_ids]
        return out

    def engine():
        return EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=64))

    prompt = [3 + (7 * i) % 200 for i in range(10)]
    core, real = engine(), None

    def fail(sched, overlap=False):
        raise RuntimeError("out of memory (simulated)")

    # A prompt's step fails: none of its blocks stays cached.
    real, core.runner.launch = core.runner.launch, fail
    core.add_request("first", prompt, params)
    assert [o.finish_reason for o in core.step()] == ["error"]
    assert core.kv.pool.num_cached == 0
    core.runner.launch = real
    assert generate(core, "retry", prompt) == generate(engine(), "ref", prompt)
    # A decode step that fills block 2 (positions 8-11: the prompt's last two, then g0 and g1) fails.
    core = engine()
    core.add_request("d", prompt, params)
    made = [t for _ in range(2) for o in core.step() for t in o.new_token_ids]  # prefill: g0; then g1
    assert len(made) == 2 and core.kv.pool.num_cached == 2  # blocks 0 and 1, full and written
    real, core.runner.launch = core.runner.launch, fail
    assert [o.finish_reason for o in core.step()] == ["error"]  # its step would write position 11
    assert core.kv.pool.num_cached == 2
    core.runner.launch = real
    longer = [*prompt, *made, 17]
    assert generate(core, "on", longer) == generate(engine(), "ref", longer)
    assert core.stats().num_free_blocks == 64


def test_stats_count_prompt_and_generated_tokens(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    llm.generate(
        [[3] * 10, [4] * 20], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    s = llm.stats()
    assert (s.prompt_tokens, s.generation_tokens) == (30, 10)
    assert s.prefix_cache_queries == 30


def test_priority_policy_serves_urgent_requests_first(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    seen: list[str] = []
    real_step = llm.core.step

    def recording_step():
        outs = real_step()
        seen.extend(o.request_id for o in outs if o.finished)
        return outs

    llm.core.step = recording_step
    outs = llm.generate(
        [[3] * 5, [4] * 5, [5] * 5],
        SamplingParams(max_tokens=3, ignore_eos=True),
        priorities=[5, 0, 9],
        use_tqdm=False,
    )
    order = [outs[i].request_id for i in (1, 0, 2)]
    assert seen == order


def test_bad_priorities_are_refused_before_anything_is_queued_and_the_engine_goes_on(tiny_llama):
    """A wrong count or type, or priorities for an engine that does not schedule by them: a
    ValueError before any request is queued (one left queued broke every later generate())."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, scheduling_policy="priority")
    for bad in ([1], ["x", None, 2], [1, True, 2]):
        with pytest.raises(ValueError, match="priorities must be 3 integers"):
            llm.generate([[3] * 5, [4] * 5, [5] * 5], params, priorities=bad, use_tqdm=False)
        assert not llm.core.has_unfinished()
    assert llm.generate([[3] * 5], params, use_tqdm=False)[0].finished
    fifo = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    with pytest.raises(ValueError, match="need scheduling_policy='priority'"):
        fifo.generate([[3] * 5], params, priorities=[1], use_tqdm=False)


def test_a_request_that_fails_to_queue_leaves_the_ones_before_it_aborted(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    real_add, added = llm.core.add_request, []

    def add_request(rid, toks, params, **kw):
        if added:
            raise RuntimeError("injected")
        added.append(rid)
        return real_add(rid, toks, params, **kw)

    monkeypatch.setattr(llm.core, "add_request", add_request)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[3] * 5, [4] * 5], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(added) == 1 and not llm.core.has_unfinished()
    monkeypatch.undo()
    assert llm.generate([[3] * 5], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_cpu_threads_sets_the_engines_torch_threads(tiny_llama):
    """A Ray replica inherits OMP_NUM_THREADS = its CPUs (often 1); cpu_threads gives its engine the
    threads the operator wants."""
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=16, cpu_threads=want))
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model=str(tiny_llama), cpu_threads=0)


def test_max_tokens_none_generates_up_to_the_context(tiny_llama):
    """As in vLLM (and pdserve's HTTP API's ``max_tokens: null``): None is what the context leaves."""
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, max_model_len=48)
    out = llm.generate([[3] * 10], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 48 - 10 and out.finish_reason == "length"
    small = LLM(str(tiny_llama), block_size=8, num_blocks=4, max_model_len=48)  # the pool leaves 32
    out = small.generate([[3] * 10], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 32 - 10
    with pytest.raises(ValueError, match="exceeds the model's context length of 48"):
        llm.generate([[3] * 48], SamplingParams(max_tokens=None), use_tqdm=False)


def test_vllm_style_calls_work(tiny_llama):
    """``generate(prompts, sampling_params=...)`` by vLLM's keyword; ``.stop_reason`` on the output."""
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    out = llm.generate(
        [[3] * 5], sampling_params=SamplingParams(max_tokens=4, stop_token_ids=[7]), use_tqdm=False
    )[0]
    assert out.stop_reason == out.outputs[0].stop_reason and out.finished
