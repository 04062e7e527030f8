"""prompt_logprobs: each prompt token's logprob given the ones before it, with top-k alternatives,
equal to HF transformers' log-softmax at every position; across chunked prefill, a prefix-cache hit
(the prompt is computed in full anyway) and preemption; the first entry is None."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [list(range(40, 77)), [5, 9, 9, 17, 3, 3, 3, 40, 12, 13, 14]]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def ref(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return ref


def _check(out, prompt, ref, k):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry, want = plp[pos], ref[pos - 1]
        tok = prompt[pos]
        assert next(iter(entry)) == tok  # the prompt's own token first
        assert entry[tok] == pytest.approx(float(want[tok]), abs=1e-4)
        top = torch.topk(want, k).indices.tolist() if k else []
        assert set(entry) == {tok, *top}
        for t in top:
            assert entry[t] == pytest.approx(float(want[t]), abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_hf_through_chunks_cache_hits_and_preemption(tiny_llama, hf_logprobs, k):
    # 8-token chunks; 14 blocks of 4 tokens force a preemption while both prompts decode.
    llm = LLM(str(tiny_llama), num_blocks=14, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=k)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        _check(out, prompt, hf_logprobs(prompt), k)
    # With the prompt's blocks in the cache, a request that wants prompt logprobs computes them all.
    roomy = LLM(str(tiny_llama), num_blocks=256, block_size=4)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = roomy.generate(PROMPTS[0], plain, use_tqdm=False)[0]
    again = roomy.generate(PROMPTS[0], params, use_tqdm=False)[0]
    _check(again, PROMPTS[0], hf_logprobs(PROMPTS[0]), k)
    assert again.num_cached_tokens == 0
    cached = roomy.generate(PROMPTS[0], plain, use_tqdm=False)[0]
    assert cached.prompt_logprobs is None and cached.num_cached_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prompt_logprobs_bounds():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(prompt_logprobs=2).continued(3).prompt_logprobs is None
