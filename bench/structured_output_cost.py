"""What structured output costs the engine: output tokens/s with a JSON-schema grammar against the
same requests unconstrained, at concurrency 1 and 32 (closed loop: a request joins as one ends).

The grammar's next-token mask is filled on a helper thread while the forward pass runs, then applied
to the logits; this measures what is left of that cost per step. The model is the tiny random Llama
with a byte-level BPE tokenizer (so JSON is expressible); constrained requests end on EOS once their
document is complete, unconstrained ones run to the same lengths (``max_tokens`` set from the
constrained run), so both sides generate the same number of tokens.

    python -m bench.structured_output_cost            # --requests 96 --schema-only
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from engine import LLM, SamplingParams, StructuredOutput
from engine.tiny_model import create_byte_level_model

RESULTS = Path(__file__).parent / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


def closed_loop(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int
) -> tuple[float, int]:
    """(output tokens/s, tokens) with at most ``concurrency`` requests in the engine."""
    core = llm.core
    pending = iter(range(len(prompts)))
    tokens = 0

    def add_next() -> None:
        i = next(pending, None)
        if i is not None:
            core.add_request(f"r{i}-{time.monotonic_ns()}", prompts[i], params[i])

    for _ in range(concurrency):
        add_next()
    t0 = time.perf_counter()
    while core.has_unfinished():
        for out in core.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                add_next()
    return tokens / (time.perf_counter() - t0), tokens


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.structured_output_cost", description=__doc__)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--output", default=str(RESULTS / "structured_output_cost.json"))
    a = p.parse_args()
    model = create_byte_level_model(
        Path(tempfile.mkdtemp()) / "tiny-byte-level", weight_scale=4.0, randomize_all=True
    )
    llm = LLM(str(model), num_blocks=2048, block_size=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 600) for _ in range(16)] for _ in range(a.requests)]
    grammar = StructuredOutput("json_schema", json.dumps(SCHEMA))
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=128, structured=grammar) for i in range(a.requests)
    ]
    # Warm-up (compiles the grammar once) and the lengths the unconstrained side will match.
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained, use_tqdm=False)]
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)
    ]
    rows = []
    for concurrency in (1, 32):
        n = min(a.requests, 16 if concurrency == 1 else a.requests)
        base, _ = closed_loop(llm, prompts[:n], free[:n], concurrency)
        with_grammar, tokens = closed_loop(llm, prompts[:n], constrained[:n], concurrency)
        rows.append(
            {
                "concurrency": concurrency,
                "requests": n,
                "tokens": tokens,
                "unconstrained_tokens_per_s": base,
                "json_schema_tokens_per_s": with_grammar,
                "ratio": with_grammar / base,
            }
        )
        print(
            f"concurrency {concurrency:>2}: unconstrained {base:8.1f} tok/s, json_schema {with_grammar:8.1f} tok/s"
            f"  -> {with_grammar / base:.2f}x ({tokens} tokens, {n} requests)",
            flush=True,
        )
    Path(a.output).write_text(json.dumps({"schema": SCHEMA, "rows": rows}, indent=2))
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
