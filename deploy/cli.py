"""The ``pdserve`` command line.

``pdserve generate``: run the offline engine on a model (a tiny random one it creates if none is
given) and print the generations and throughput. ``pdserve serve``: the OpenAI-compatible service on
Ray Serve (``--demo``: send a few requests through it and exit). ``pdserve status``: the workers of
a running service.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = [
    "the world is",
    "there was a man who",
    "in the first years of the new state",
    "what people know about life",
]
TINY_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "tiny-llama"


def ensure_tiny_model() -> Path:
    from engine.tiny_model import LLAMA_32M, build_tokenizer, create_tiny_model

    if not (TINY_MODEL_DIR / "config.json").exists():
        print(f"no --model given: creating a tiny random Llama in {TINY_MODEL_DIR}", file=sys.stderr)
        create_tiny_model(TINY_MODEL_DIR, "llama", **LLAMA_32M)
    elif not (TINY_MODEL_DIR / "chat_template.jinja").exists():  # made before chat templates
        build_tokenizer(LLAMA_32M.get("vocab_size", 1024)).save_pretrained(TINY_MODEL_DIR)
    return TINY_MODEL_DIR


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    model = args.model or str(ensure_tiny_model())
    print(f"loading {model} ...", file=sys.stderr)
    llm = LLM(model, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks, seed=args.seed)
    prompts = args.prompt or DEFAULT_PROMPTS
    prompts = prompts * max(1, args.repeat)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation with the engine")
    g.add_argument("--model", help="checkpoint directory or Hugging Face id (default: a tiny random Llama)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--repeat", type=int, default=8, help="submit the prompts this many times (default 8)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="pin the KV pool size (default: from memory)")
    g.set_defaults(func=cmd_generate)
    _add_serve_parser(sub)
    st = sub.add_parser("status", help="workers, roles, load, KV usage and hit rates of a running service")
    st.add_argument("--address", default=None, help="Ray cluster address (default: the local one)")
    st.add_argument("--app", default="pdserve", help="Serve application name")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=lambda a: _serve_module().cmd_status(a))
    sc = sub.add_parser("scale", help="change a running service's prefill/decode replica counts in place")
    sc.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    sc.add_argument("--decode", type=int, default=None, help="decode replicas")
    sc.add_argument("--address", default=None, help="Ray cluster address (default: the local one)")
    sc.add_argument("--app", default="pdserve", help="Serve application name")
    sc.set_defaults(func=lambda a: _serve_module().cmd_scale(a))
    b = sub.add_parser("bench", help="load-test any OpenAI-compatible server (TTFT, TPOT, ITL, E2E, goodput)")
    from bench.serving_client import add_bench_args

    add_bench_args(b)
    b.set_defaults(func=cmd_bench)
    mf = sub.add_parser(
        "manifests", help="render the KubeRay RayService, Redis and Serve config from a values file"
    )
    mf.add_argument("--values", default="deploy/kuberay/values.yaml", help="the values file")
    mf.add_argument("--out", default="deploy/kuberay", help="output directory")
    mf.set_defaults(func=cmd_manifests)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.serving_client import run

    result = run(args)
    return 0 if all(r["completed"] for r in result["runs"]) else 1


def cmd_manifests(args: argparse.Namespace) -> int:
    from deploy.manifests import write

    for path in write(Path(args.values), Path(args.out)):
        print(f"wrote {path}")
    return 0


def _serve_module():
    from deploy import serve_command

    return serve_command


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve (prefill, decode, router)")
    s.add_argument("--model", help="checkpoint directory or Hugging Face id (default: a tiny random Llama)")
    s.add_argument(
        "--config",
        help="the application config (YAML/JSON PDServeConfig, or a Serve config file); "
        "replaces the model, engine and pool flags",
    )
    s.add_argument("--served-model-name", help="the model name clients use (default: --model)")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--prefill", type=int, default=1, help="prefill replicas")
    s.add_argument("--decode", type=int, default=1, help="decode replicas")
    s.add_argument("--mode", default="disaggregated", choices=["disaggregated", "aggregated"])
    s.add_argument("--policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"])
    s.add_argument(
        "--redis-url",
        default=os.environ.get("PDSERVE_REDIS_URL"),
        help="registry Redis (env PDSERVE_REDIS_URL; default: an embedded Redis-protocol server)",
    )
    s.add_argument(
        "--api-key", default=None, help="require this bearer key on /v1 (prefer env PDSERVE_API_KEY)"
    )
    s.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--device", default=None, help="engine device (default: cpu)")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, default=None, help="pin each worker's KV pool size")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument(
        "--max-concurrent-requests", type=int, default=256, help="beyond it requests queue, then 429"
    )
    s.add_argument(
        "--worker-cpus", type=float, default=1.0, help="Ray CPUs reserved per prefill/decode replica"
    )
    s.add_argument("--worker-gpus", type=float, default=0.0, help="GPUs per prefill/decode replica")
    s.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to let requests finish on shutdown"
    )
    s.add_argument("--demo", action="store_true", help="send a few requests through the service, then exit")
    s.set_defaults(func=lambda a: _serve_module().cmd_serve(a))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
