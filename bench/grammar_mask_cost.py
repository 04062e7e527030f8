"""Per-step grammar mask cost at batch 32: xgrammar vs outlines-core (issue 18, item 3).

Trains a byte-level BPE tokenizer offline on the standard library's sources, then for each
installed library and each grammar (a JSON schema with and without length bounds, any-JSON)
measures: compile time; the time to fill the next-token bitmask for a whole batch whose requests
sit at different points of a valid document (replayed token by token, each token checked against
its mask, lm_head rows past the tokenizer's vocab checked to be masked out); the time to advance
one matcher by one token; and how much of the GIL a mask-filling thread leaves to the main thread
(1.0: it overlaps fully with Python work such as launching the model's forward pass).

    python -m bench.grammar_mask_cost [--batch 32] [--steps 500] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
CORPUS_BYTES_PER_TOKEN = 400  # enough text for the trainer to reach the asked vocab
WORDS = ["alpha", "beta", "gamma", "kv", "cache", "prefill", "decode", "router", "block", "tensor"]
ROLES = ["admin", "user", "guest"]
GRAMMARS = ("schema", "schema-nobounds", "any-json")


def json_schema(bounded: bool) -> dict[str, Any]:
    """A moderate schema; its bounds (maxLength above all) are what slow xgrammar's masks down."""
    name, age, tags = ({"maxLength": 40}, {"minimum": 0}, {"maxItems": 5}) if bounded else ({}, {}, {})
    props = {
        "name": {"type": "string", **name},
        "age": {"type": "integer", **age},
        "role": {"enum": ROLES},
        "tags": {"type": "array", "items": {"type": "string"}, **tags},
    }
    return {"type": "object", "properties": props, "required": list(props)}


def build_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if size > vocab * CORPUS_BYTES_PER_TOKEN:
            break
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=[EOS], initial_alphabet=alphabet, show_progress=False
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def make_docs(grammar: str, n: int, rng: random.Random) -> list[str]:
    def text() -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))

    def scalar() -> Any:
        return rng.choice([text(), rng.randint(-999, 99999), rng.random() * 100, True, False, None])

    docs = []
    for _ in range(n):
        if grammar.startswith("schema"):
            doc = {"name": text(), "age": rng.randint(0, 120), "role": rng.choice(ROLES)}
            doc["tags"] = [text() for _ in range(rng.randint(0, 5))]
        else:  # nesting kept within outlines-core's default max_recursion_depth=3
            doc = {f"k{i}": scalar() for i in range(rng.randint(1, 4))}
            doc["obj"] = {f"{rng.choice(WORDS)}{i}": scalar() for i in range(rng.randint(1, 3))}
            doc["arr"] = [scalar() for _ in range(rng.randint(0, 4))]
        docs.append(json.dumps(doc))
    return docs


class Xgrammar:
    """One GrammarMatcher per request; the batch filled in one call (BatchGrammarMatcher)."""

    name = "xgrammar"

    def __init__(self, tokenizer: PreTrainedTokenizerFast, model_vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_vocab)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.batcher = xgr.BatchGrammarMatcher()
        self.eos = tokenizer.eos_token_id

    def compile(self, grammar: str) -> Any:
        if grammar == "any-json":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(json_schema(grammar == "schema")))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token}")

    def finish(self, matcher: Any) -> None:
        self.advance(matcher, self.eos)  # EOS is a real token here: the matcher terminates on it
        if not matcher.is_terminated():
            raise RuntimeError("xgrammar matcher did not terminate on EOS")
        matcher.reset()


class OutlinesCore:
    """One Guide per request over a shared Index (a token-level DFA); no batch API."""

    name = "outlines-core"

    def __init__(self, tokenizer: PreTrainedTokenizerFast, model_vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        byte_of = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
        tokens: dict[bytes, list[int]] = {}
        for piece, token_id in tokenizer.get_vocab().items():
            if token_id != tokenizer.eos_token_id:
                tokens.setdefault(bytes(byte_of[ch] for ch in piece), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)
        self.eos = tokenizer.eos_token_id

    def compile(self, grammar: str) -> Any:
        schema = {"type": "object"} if grammar == "any-json" else json_schema(grammar == "schema")
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        row, words = bitmask.data_ptr(), bitmask.shape[1]
        for i, guide in enumerate(matchers):
            guide.write_mask_into(row + 4 * words * i, words, 4)

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token, return_tokens=False)

    def finish(self, matcher: Any) -> None:
        # NOTE: Guide.advance(eos) raises; a finished request is is_finished() with EOS in its mask.
        if not matcher.is_finished():
            raise RuntimeError("outlines-core guide not in a final state at the end of the document")
        matcher.reset()


def _bytes_to_unicode() -> list[str]:
    """The GPT-2 byte-level alphabet: entry b is the character that stands for byte b."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


@dataclass(frozen=True, slots=True)
class Row:
    library: str
    grammar: str
    compile_ms: float
    mask_p50_ms: float
    mask_p90_ms: float
    advance_us: float
    allowed: float  # mean allowed tokens per row: a sanity check that the masks are real
    gil_share: float


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def id_bits(lo: int, hi: int, words: int) -> torch.Tensor:
    """A bitmask row with the bits of token ids lo..hi-1 set."""
    ids = torch.arange(words * 32).view(words, 32)
    return (((ids >= lo) & (ids < hi)).int() << torch.arange(32)).sum(1).int()


POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)])


def spin(seconds: float) -> int:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count


def gil_share(work: Callable[[], None], seconds: float) -> float:
    """Main-thread spin rate while `work` loops on a thread, over the rate alone."""
    alone, done = spin(seconds), threading.Event()

    def loop() -> None:
        while not done.is_set():
            work()

    thread = threading.Thread(target=loop)
    thread.start()
    shared = spin(seconds)
    done.set()
    thread.join()
    return shared / alone


def measure(lib: Any, grammar: str, tokenizer: Any, args: argparse.Namespace, model_vocab: int) -> Row:
    start = time.perf_counter()
    compiled = lib.compile(grammar)
    compile_ms = (time.perf_counter() - start) * 1e3
    docs = make_docs(grammar, args.batch, random.Random(args.seed))
    docs_tokens = [tokenizer.encode(doc, add_special_tokens=False) for doc in docs]
    matchers = [lib.matcher(compiled) for _ in docs]
    positions = [i * len(tokens) // len(docs) for i, tokens in enumerate(docs_tokens)]  # spread the batch
    for matcher, tokens, pos in zip(matchers, docs_tokens, positions):
        for token in tokens[:pos]:
            lib.advance(matcher, token)
    bitmask = torch.zeros(len(docs), -(-model_vocab // 32), dtype=torch.int32)
    # NOTE: xgrammar may set the bits past model_vocab in the last word, so neither mask covers them.
    valid, padding = (
        id_bits(0, model_vocab, bitmask.shape[1]),
        id_bits(len(tokenizer), model_vocab, bitmask.shape[1]),
    )
    mask_ms: list[float] = []
    advance_us: list[float] = []
    allowed_total = 0
    for _ in range(args.steps):
        start = time.perf_counter()
        lib.fill(matchers, bitmask)
        mask_ms.append((time.perf_counter() - start) * 1e3)
        allowed_total += int(POPCOUNT[(bitmask & valid).view(torch.uint8).long()].sum())
        if (bitmask & padding).any():
            raise RuntimeError(f"{lib.name}: an lm_head row past the tokenizer's vocab is allowed")
        for i, (matcher, tokens) in enumerate(zip(matchers, docs_tokens)):
            token = tokens[positions[i]] if positions[i] < len(tokens) else lib.eos
            if not allowed(bitmask, i, token):
                raise RuntimeError(f"{lib.name}: token {token} of a valid {grammar} document masked out")
            if token == lib.eos:
                lib.finish(matcher)
                positions[i] = 0
                continue
            start = time.perf_counter()
            lib.advance(matcher, token)
            advance_us.append((time.perf_counter() - start) * 1e6)
            positions[i] += 1
    share = gil_share(lambda: lib.fill(matchers, bitmask), args.gil_seconds)
    p50, p90 = statistics.median(mask_ms), statistics.quantiles(mask_ms, n=10)[8]
    mean_allowed = allowed_total / (args.steps * len(docs))
    return Row(lib.name, grammar, compile_ms, p50, p90, statistics.median(advance_us), mean_allowed, share)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size to train")
    parser.add_argument("--lm-head-extra", type=int, default=64, help="lm_head rows past the tokenizer's")
    parser.add_argument("--gil-seconds", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 10 or args.vocab < 512 or args.lm_head_extra < 0:
        parser.error("need --batch >= 1, --steps >= 10, --vocab >= 512, --lm-head-extra >= 0")

    start = time.perf_counter()
    tokenizer = build_tokenizer(args.vocab)
    model_vocab = len(tokenizer) + args.lm_head_extra  # padded lm_heads are common (Qwen2: 151936 vs 151665)
    print(
        f"tokenizer: {len(tokenizer)} tokens (model vocab {model_vocab}) in {time.perf_counter() - start:.1f}s"
    )

    rows: list[Row] = []
    for backend in (Xgrammar, OutlinesCore):
        try:
            start = time.perf_counter()
            lib = backend(tokenizer, model_vocab)
        except ImportError as exc:
            print(f"{backend.name}: not installed ({exc})")
            continue
        print(f"{backend.name}: vocabulary setup {(time.perf_counter() - start) * 1e3:.0f} ms")
        rows += [measure(lib, grammar, tokenizer, args, model_vocab) for grammar in GRAMMARS]

    print(f"\nbatch {args.batch}, {args.steps} steps, vocab {model_vocab}")
    header = f"{'library':<14}{'grammar':<17}{'compile ms':>11}{'mask p50 ms':>12}{'mask p90 ms':>12}"
    print(header + f"{'advance us':>11}{'allowed':>9}{'GIL left':>9}")
    for r in rows:
        print(
            f"{r.library:<14}{r.grammar:<17}{r.compile_ms:>11.1f}{r.mask_p50_ms:>12.3f}{r.mask_p90_ms:>12.3f}"
            f"{r.advance_us:>11.1f}{r.allowed:>9.0f}{r.gil_share:>9.2f}"
        )
    by_key = {(r.library, r.grammar): r for r in rows}
    for grammar in GRAMMARS:
        xg, oc = by_key.get(("xgrammar", grammar)), by_key.get(("outlines-core", grammar))
        if xg and oc:
            print(
                f"{grammar}: outlines-core / xgrammar = {oc.mask_p50_ms / xg.mask_p50_ms:.2f}x mask p50, "
                f"{oc.compile_ms / xg.compile_ms:.2f}x compile, {oc.advance_us / xg.advance_us:.2f}x advance"
            )


if __name__ == "__main__":
    main()
