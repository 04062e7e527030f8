"""``pdserve generate``: run the offline engine on a model (a tiny random one it creates if none is
given) and print the generations and throughput."""

from __future__ import annotations

import argparse
import sys
import time

from cli.tiny_model import ensure_tiny_model
from engine.args import add_engine_args, engine_kwargs_from_args

DEFAULT_PROMPTS = [
    "the world is",
    "there was a man who",
    "in the first years of the new state",
    "what people know about life",
]


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="offline generation with the engine")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--repeat", type=int, default=1, help="submit the prompts this many times (default 1)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    add_engine_args(
        g,
        model_required=False,
        model_help="checkpoint directory or Hugging Face id (default: a tiny random Llama)",
    )
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    prompts = (args.prompt or DEFAULT_PROMPTS) * args.repeat
    params = SamplingParams(  # checked before the model loads
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    model = args.model or str(ensure_tiny_model())
    print(f"loading {model} ...", file=sys.stderr)
    llm = LLM(model, **engine_kwargs_from_args(args))
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for out in outputs[: len(args.prompt or DEFAULT_PROMPTS)]:
        print(
            f"\nprompt: {out.prompt!r}\noutput: {out.text!r}  [{out.finish_reason}, {len(out.token_ids)} tokens]"
        )
    generated = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    print(
        f"\n{len(outputs)} requests, {generated} tokens in {elapsed:.2f}s: {generated / elapsed:.1f} tokens/s "
        f"(prefix-cache hit rate {stats.prefix_cache_hit_rate:.0%}, preemptions {stats.num_preemptions})"
    )
    if stats.spec_num_drafts:
        per_pos = ", ".join(f"{n / stats.spec_num_drafts:.0%}" for n in stats.spec_accepted_per_position)
        print(
            f"speculative decoding: acceptance {stats.spec_acceptance_rate:.0%}, mean accepted length "
            f"{stats.spec_mean_accepted_length:.2f} tokens/step, accepted per position: {per_pos}"
        )
    return 0
