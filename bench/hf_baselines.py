"""HF transformers peers for the offline throughput benchmark (same process, CPU, float32).

* :func:`run_hf_static` -- classic static batching: ``model.generate`` on fixed batches (request order, left
  padding + attention mask, greedy, EOS disabled). Every batch runs for the *longest* ``max_tokens`` in it; only
  each request's own ``max_tokens`` count as useful tokens, so the padding waste of static batching shows up.
* :func:`run_hf_continuous` -- transformers 5.x continuous batching (``ContinuousBatchingManager`` from
  ``model.init_continuous_batching``) with a per-request ``max_new_tokens`` and EOS disabled (``eos_token_id=-1``).

Continuous-batching settings for CPU (see :func:`_cb_config`): ``sdpa`` attention (flash is CUDA-only; on CPU the
manager keeps ``sdpa`` and runs its varlen path with a block-diagonal mask), no CUDA graphs / async batching / compile,
no prefix sharing (random prompts never share blocks), ``page_size=64`` and a cache sized to hold the whole workload
at once plus 25% headroom (the FIFO scheduler stops admitting prefills when <15% blocks are free), so nothing is ever
offloaded; ``max_batch_tokens=1024`` bounds the per-step token budget (decode tokens first, then prefill chunks;
256-2048 measured within ~10% of each other on the 48-request skewed workload, 1024 best).
Setting ``num_blocks`` explicitly also matters because transformers sizes the CPU cache from psutil / NUMA memory.

Smoke test: ``python -m bench.hf_baselines --model-dir DIR --num-requests 8 [--max-tokens-cap 32] [--verify 2]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, PreTrainedModel

from loadgen.workloads import BenchRequest, skewed_workload

logger = logging.getLogger(__name__)

PAD_TOKEN_ID = 0  # workloads draw token ids from [10, vocab): 0 never appears in a prompt
CB_PAGE_SIZE = 64
CB_MAX_BATCH_TOKENS = 1024
CB_CACHE_HEADROOM = 1.25


@dataclass
class HFResult:
    """Outcome of one benchmark run; ``generated_tokens`` counts only useful (requested) tokens."""

    name: str
    seconds: float
    generated_tokens: int
    prompt_tokens: int
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.name}: {self.generated_tokens} generated tokens ({self.prompt_tokens} prompt) in "
            f"{self.seconds:.2f}s -> {self.tokens_per_s:.1f} tok/s"
        )


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """Load a causal LM in eval mode with SDPA attention (works for both generate and CB)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _left_pad(prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def generate_static_batch(
    model: PreTrainedModel, prompts: Sequence[list[int]], max_new_tokens: int
) -> torch.Tensor:
    """Greedy ``model.generate`` on a left-padded batch, EOS disabled; returns the new tokens ``[B, max_new_tokens]``."""
    input_ids, attention_mask = _left_pad(prompts)
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,  # explicit None overrides the model's generation_config: no EOS stopping criterion
        pad_token_id=PAD_TOKEN_ID,
    )
    new_tokens = out[:, input_ids.shape[1] :]
    if new_tokens.shape[1] != max_new_tokens:
        raise RuntimeError(f"generate stopped early: {new_tokens.shape[1]} of {max_new_tokens} new tokens")
    return new_tokens


def run_hf_static(
    model: PreTrainedModel, requests: list[BenchRequest], batch_size: int = 8, progress: bool = True
) -> HFResult:
    """Static batching: consecutive batches of ``batch_size`` requests, each run to its longest ``max_tokens``."""
    outputs: list[list[int]] = []
    useful = padded = 0
    with tqdm(total=len(requests), desc="hf-static", unit="req", disable=not progress) as pbar:
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            longest = max(r.max_tokens for r in batch)
            new_tokens = generate_static_batch(model, [r.prompt_token_ids for r in batch], longest)
            for req, row in zip(batch, new_tokens.tolist()):
                outputs.append(row[: req.max_tokens])
            useful += sum(r.max_tokens for r in batch)
            padded += longest * len(batch)
            pbar.update(len(batch))
            pbar.set_postfix(tok_s=f"{useful / (time.perf_counter() - start):.1f}")
        seconds = time.perf_counter() - start
    logger.info(
        "hf-static: %d useful of %d computed decode tokens (%.0f%%)", useful, padded, 100 * useful / padded
    )
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return HFResult("hf-static", seconds, sum(len(o) for o in outputs), prompt_tokens, outputs)


def _cb_config(requests: list[BenchRequest]) -> ContinuousBatchingConfig:
    """CPU-friendly CB config with a cache that holds every request at once (see module docstring)."""
    blocks = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens + 1) / CB_PAGE_SIZE) for r in requests)
    return ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=math.ceil(blocks * CB_CACHE_HEADROOM) + 4,
        max_batch_tokens=CB_MAX_BATCH_TOKENS,
        max_requests_per_batch=max(1, len(requests)),
        allow_block_sharing=False,
        use_async_batching=False,
        use_cuda_graph=False,
        auto_switch_to_flash=False,
        scheduler_type="fifo",
        seed=0,
    )


def run_hf_continuous(
    model: PreTrainedModel, requests: list[BenchRequest], progress: bool = True
) -> HFResult:
    """Continuous batching via ``ContinuousBatchingManager``: all requests submitted up front, each with its own
    ``max_new_tokens`` and ``eos_token_id=-1``; timed from submission until the last result arrives."""
    gen_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in requests),
        eos_token_id=-1,
        pad_token_id=PAD_TOKEN_ID,
    )
    cb_config = _cb_config(requests)
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config
    )
    manager.warmup()  # allocates the paged cache before timing starts; no forward passes without CUDA graphs
    manager.start()
    expected: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    try:
        with tqdm(total=len(requests), desc="hf-continuous", unit="req", disable=not progress) as pbar:
            start = time.perf_counter()
            for i, req in enumerate(requests):
                request_id = f"req_{i}"
                manager.add_request(
                    input_ids=req.prompt_token_ids,
                    request_id=request_id,
                    max_new_tokens=req.max_tokens,
                    eos_token_id=-1,  # negative ids are dropped: the request has no EOS at all
                )
                expected[request_id] = req.max_tokens
            while len(outputs) < len(requests):
                result = manager.get_result(timeout=1.0)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("continuous batching loop died") from (
                            manager.background_thread_status.fatal_error
                        )
                    continue
                if not result.is_finished():
                    continue
                if result.error is not None:
                    raise RuntimeError(f"{result.request_id} failed: {result.error}")
                outputs[result.request_id] = list(result.generated_tokens)
                pbar.update(1)
                done = sum(len(o) for o in outputs.values())
                pbar.set_postfix(tok_s=f"{done / (time.perf_counter() - start):.1f}")
            seconds = time.perf_counter() - start
        cfg = manager.continuous_batching_config
        logger.info(
            "hf-continuous: page_size=%d num_blocks=%d max_batch_tokens=%d max_requests_per_batch=%d",
            cfg.page_size,
            cfg.num_blocks,
            cfg.max_batch_tokens,
            cfg.max_requests_per_batch,
        )
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    ordered = [outputs[f"req_{i}"] for i in range(len(requests))]
    wrong = {rid: (len(outputs[rid]), n) for rid, n in expected.items() if len(outputs[rid]) != n}
    if wrong:
        raise RuntimeError(f"requests with a wrong number of generated tokens (got, expected): {wrong}")
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return HFResult("hf-continuous", seconds, sum(len(o) for o in ordered), prompt_tokens, ordered)


def verify_against_generate(
    model: PreTrainedModel, requests: list[BenchRequest], result: HFResult, n: int
) -> int:
    """Compare the first ``n`` outputs of ``result`` with greedy ``model.generate`` run alone; returns mismatches."""
    mismatches = 0
    for i, req in enumerate(requests[:n]):
        reference = generate_static_batch(model, [req.prompt_token_ids], req.max_tokens)[0].tolist()
        got = result.output_token_ids[i]
        if got != reference:
            mismatches += 1
            first = next(
                (j for j, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference))
            )
            logger.warning(
                "%s req %d differs from generate() at token %d of %d", result.name, i, first, req.max_tokens
            )
    return mismatches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="clamp each request's max_tokens")
    parser.add_argument("--modes", default="static,continuous")
    parser.add_argument("--verify", type=int, default=0, help="check N outputs against generate() run alone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    model = load_hf_model(args.model_dir)
    requests = skewed_workload(args.num_requests, vocab_size=model.config.vocab_size, seed=args.seed)
    if args.max_tokens_cap is not None:
        requests = [
            BenchRequest(r.prompt_token_ids, min(r.max_tokens, args.max_tokens_cap)) for r in requests
        ]
    runners = {
        "static": lambda: run_hf_static(model, requests, batch_size=args.batch_size),
        "continuous": lambda: run_hf_continuous(model, requests),
    }
    for mode in args.modes.split(","):
        result = runners[mode]()
        print(result.summary())
        if args.verify:
            print(
                f"  {result.name}: {verify_against_generate(model, requests, result, args.verify)} mismatches"
            )


if __name__ == "__main__":
    main()
