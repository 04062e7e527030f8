"""Incremental detokenization and stop strings, per output sequence.

Decoding only a short window of recent tokens keeps each step O(1) in the output length; a
window that ends in an incomplete UTF-8 sequence (U+FFFD) waits for the next token. Stop strings
are searched in the tail where a new match can start; on a match the text is cut before the stop
string (or after it with ``include_stop_str_in_output``). Under ``min_tokens`` a stop string counts
only if it ends in text produced after the first ``min_tokens`` tokens (vLLM's rule).

``pieces`` says what each token of the last ``add`` contributed to ``text`` (before a stop-string
cut), so per-token views (logprob tokens, their offsets) line up with the text exactly.

When the output ends while an incomplete UTF-8 sequence is pending, ``flush`` (at the end of the
sequence) appends what the tokenizer makes of those bytes (U+FFFD for a partial character), so the
final text is the tokenizer's decode of every returned token, last bytes included.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

from engine.sampling_params import SamplingParams

_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, as one call into the Rust tokenizer
    where HF's Python layers around it change nothing (a fast tokenizer that overrides neither
    ``decode`` nor ``_decode`` and does not clean up spaces): those layers (``to_py_obj`` over every
    id, keyword plumbing) were a third of a decode's time, and the detokenizer decodes twice a token.
    Any other tokenizer gets its own ``decode``."""
    try:
        return _DECODERS[tokenizer]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable
        pass
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    plain = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls._decode is PreTrainedTokenizerFast._decode
        and cls.decode is PreTrainedTokenizerBase.decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        and backend is not None
    )
    if not plain:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    # The backend's method, not the tokenizer's: the cache holds no reference to its key.
    decode = functools.partial(backend.decode, skip_special_tokens=True)
    _DECODERS[tokenizer] = decode
    return decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self.params = params
        self.tokens: list[int] = list(prompt_token_ids[-6:])
        # Offsets into self.tokens: [prefix, read) is decoded context, [read, end) is pending.
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # Per token of the last add(): the text it completed, or None while it ends inside an
        # incomplete UTF-8 sequence (its bytes come out with a later token's text).
        self.pieces: list[str | None] = []
        self._incomplete = False
        self.num_output_tokens = 0
        self.kept = 0  # tokens of the last add() that count (fewer when a stop string matched)
        # A stop token (``stop_token_ids``) ends the output without its text, as vLLM's detokenizer
        # leaves it out (unless ``include_stop_str_in_output``); it still counts as a token.
        self._stop_ids = frozenset(() if params.include_stop_str_in_output else params.stop_token_ids)
        self.stop_token: int | None = None  # the one that ended the output so (not in ``tokens``)

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the matched stop string, if the output now contains one.

        Stop strings are checked after each token, as if the tokens came one per step: on a match
        the tokens after the one that completed it are dropped (``kept`` says how many of
        ``token_ids`` count; a speculating engine emits several tokens a step)."""
        self.pieces = []
        self.kept = len(token_ids)
        min_tokens = self.params.min_tokens
        stopped = bool(token_ids) and token_ids[-1] in self._stop_ids  # it ended the output
        for i, tok in enumerate(token_ids[:-1] if stopped else token_ids):
            start = len(self.text)  # a stop string must end after this
            self.tokens.append(tok)
            piece = self._step()
            self.text += piece
            self.pieces.append(None if self._incomplete else piece)
            self.num_output_tokens += 1
            if not self._max_stop or not piece or self.num_output_tokens <= min_tokens:
                continue
            # The match that ends in this token's text and starts first (of equal starts, the
            # first in the list): the text before it holds no stop string.
            found = None
            for stop in self.params.stop:
                idx = self.text.find(stop, max(0, start - len(stop) + 1))
                if idx != -1 and (found is None or idx < found[0]):
                    found = (idx, stop)
            if found is not None:
                idx, stop = found
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                self.kept = i + 1
                return stop
        if stopped:  # counted, not shown
            self.pieces.append("")
            self.num_output_tokens += 1
            self.stop_token = token_ids[-1]
        return None

    def flush(self) -> str:
        """At the end of the output: the pending tokens' text (their bytes as the tokenizer decodes
        them, even as an incomplete character), appended to ``text`` and returned."""
        if not self._incomplete:
            return ""
        dec = self._decode
        prefix = dec(self.tokens[self.prefix_offset : self.read_offset])
        full = dec(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        self._incomplete = False
        rest = full[len(prefix) :]
        self.text += rest
        return rest

    def _step(self) -> str:
        dec = self._decode
        prefix = dec(self.tokens[self.prefix_offset : self.read_offset])
        full = dec(self.tokens[self.prefix_offset :])
        self._incomplete = full.endswith("\ufffd")
        if len(full) > len(prefix) and not self._incomplete:
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix) :]
        return ""
