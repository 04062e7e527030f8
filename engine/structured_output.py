"""Structured outputs: a grammar per request (JSON schema, any JSON, regex, a choice list, EBNF) that
only lets the sampler pick tokens keeping the output a valid prefix of the language, with xgrammar.

Lifecycle of a request's grammar: compiled once per distinct spec (cached) when the request is
validated, so a bad schema is refused before the request is queued -> a matcher per sequence, created
when the runner first sees the sequence and fed every token of its output so far (a resumed or
recomputed request, a decode worker continuing a prefill worker's first token: the matcher is
rebuilt from the tokens, nothing else crosses the wire) -> each step, the next-token bitmask is
filled on a helper thread while the model's forward pass runs (xgrammar releases the GIL), applied
to the logits before sampling, and the sampled token is accepted -> once the language is complete
only EOS is allowed, so the request ends on EOS.

JSON is generated in one fixed layout, with no free whitespace (xgrammar's ``any_whitespace=False``:
a space after each ``:`` and ``,``, none elsewhere, as ``json.dumps`` writes it): a model cannot
fill its output with whitespace it was never asked for.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


# xgrammar's errors start with a time and the C++ source line that raised them: "[00:27:18]
# /project/cpp/regex_converter.cc:83: Regex parsing error ...". A client needs only the reason.
_CPP_PREFIX = re.compile(r"^\s*(?:\[[\d:]+\]\s*)?(?:\S+\.(?:cc|cpp|h|hpp):\d+:\s*)?")


def compiler_reason(message: str) -> str:
    """A grammar compiler's error without its timestamp and source locations, on one line."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line) or "the grammar compiler refused it"


class StructuredOutputs:
    """The engine's grammar compiler and the per-sequence matchers it hands out."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler = None
        self._lock = threading.Lock()  # compiles come from gRPC threads and the engine thread
        self._cache: dict[StructuredOutput, object] = {}
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (cached); ValueError saying why for a spec it cannot compile."""
        hit = self._cache.get(spec)  # NOTE: no lock on a hit: the engine thread never waits on a compile
        if hit is not None:
            return hit
        with self._lock:
            compiler = self._get_compiler()
            try:
                compiled = _compile(compiler, spec)
            except (RuntimeError, ValueError, TypeError) as exc:
                reason = compiler_reason(str(exc))
                raise ValueError(f"cannot compile the {spec.kind} for structured output: {reason}") from exc
            while len(self._cache) >= MAX_CACHED_GRAMMARS:  # bounded: specs can be made up per request
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
            return compiled

    def matcher(self, spec: StructuredOutput, output: list[int]) -> GrammarState:
        """A matcher for ``spec`` that has accepted ``output`` (the sequence's tokens so far)."""
        import xgrammar as xgr

        state = GrammarState(xgr.GrammarMatcher(self.compile(spec)))
        for tok in output:
            state.accept(tok)
        return state

    def fill_async(self, rows: list[tuple[int, GrammarState]], num_rows: int) -> Future:
        """Starts filling a [num_rows, words] int32 bitmask (all ones where no grammar) on the helper
        thread; the caller overlaps it with the forward pass and waits on the future."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._pool.submit(self._fill, rows, num_rows)

    def _fill(self, rows: list[tuple[int, GrammarState]], num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # all ones
        for i, state in rows:
            state.matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.eos_token_ids) or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("failed", "matcher")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.failed = False

    @property
    def constraining(self) -> bool:
        """Whether the next token is still masked (not once EOS was accepted, or after a failure)."""
        return not self.failed and not self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """False when the grammar refuses the token: only when it allowed none of the model's tokens
        (a tokenizer that cannot write the language); the request then ends with an error."""
        if not self.failed and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.failed = True
        return not self.failed


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token the [N, words] int32 bitmask does not allow set to -inf."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


# xgrammar writes a string with minLength/maxLength as "prop ::= "\"" prop_characters{m, n} "\""" with
# prop_characters ::= [^"\\\r\n]: raw control characters (0x00-0x1F but CR and LF) pass, and the text
# is not JSON. Such rules are rewritten to JSON's own string character: anything but a control
# character, a quote or a backslash, or an escape (which counts as one character, as JSON's length).
_BOUNDED_CHARS = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" pdserve_json_escape))'
_JSON_ESCAPE = (
    r'pdserve_json_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
)


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of a JSON schema, every string it allows valid JSON (see ``_BOUNDED_CHARS``)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    fixed, n = _BOUNDED_CHARS.subn(lambda m: f"{m.group(1)} ::= {_JSON_CHAR}", text)
    return f"{fixed}\n{_JSON_ESCAPE}\n" if n else text


def _compile(compiler, spec: StructuredOutput):
    if spec.kind == "json_schema":
        return compiler.compile_grammar(json_schema_grammar(spec.value))
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.value)
    raise ValueError(f"unknown structured output kind {spec.kind!r}")
