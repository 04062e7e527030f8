"""How tokens read in logprobs: strings that add up to the returned text, and their real bytes.

A token decoded on its own loses what its neighbours give it (the leading space of ``"Ġthe"`` or
``"▁the"`` in many tokenizers, the space a WordPiece decoder puts between words). So the sampled
token's string is the text it added to the sample's output (``IncrementalDetokenizer.pieces``): the
strings concatenate to the text, and ``text_offset`` indexes into it. A token that ends inside a
UTF-8 sequence (a character split over byte-level tokens) has no text of its own: it is shown as
OpenAI shows it, ``"bytes:\\xe2\\x80"``, with its raw bytes in the ``bytes`` list, and so is the
token that completes the character. Raw bytes come from the tokenizer's vocabulary for byte-level
BPE (GPT-2 style) and SentencePiece-style byte fallback (``<0xE2>``); for other tokenizers (which
have no partial tokens) a token's bytes are its text's UTF-8.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CONTEXT_TOKENS = 4  # tokens before an alternative that its text is decoded after


@dataclass(slots=True)
class TokenLogprob:
    token: str
    raw: bytes  # the token's UTF-8 bytes (chat ``bytes``)
    logprob: float
    top: list[tuple[str, bytes, float]]  # the most likely tokens at this position, best first
    offset: int  # where the token's text starts in the sample's text (``text_offset``)


def bytes_token(raw: bytes) -> str:
    """OpenAI's display of a token that is not valid UTF-8 on its own."""
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenTexts:
    """One tokenizer's token strings and bytes, per token id (cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._raw_of = _raw_bytes_reader(tokenizer)
        self._raw: dict[int, bytes | None] = {}

    def raw(self, token_id: int) -> bytes | None:
        """The token's bytes from the vocabulary; None when the tokenizer's kind is not known."""
        if self._raw_of is None:
            return None
        if token_id not in self._raw:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            self._raw[token_id] = self._raw_of(piece) if isinstance(piece, str) else None
        return self._raw[token_id]

    def sampled(self, token_ids: list[int], pieces: list[str | None], split: bool) -> list[tuple[str, bytes]]:
        """(string, bytes) per sampled token, from the detokenizer's ``pieces`` of those tokens;
        ``split``: the token before them ended inside a character."""
        out = []
        for tid, piece in zip(token_ids, pieces):
            raw = self.raw(tid) if piece is None or split else None
            if raw is not None:  # a token inside a split character, or the one that completes it
                out.append((_as_text(raw), raw))
            else:  # no vocabulary bytes: the piece (a pending token adds nothing)
                text = piece or ""
                out.append((text, text.encode()))
            split = piece is None
        return out

    def alternative(self, context: list[int], token_id: int) -> tuple[str, bytes]:
        """An alternative token as it would read after ``context`` (the tokens before it)."""
        raw = self.raw(token_id)
        if raw is not None:
            return _as_text(raw), raw
        dec = self.tokenizer.decode
        ctx = context[-_CONTEXT_TOKENS:]
        before = dec(ctx, skip_special_tokens=True)
        after = dec([*ctx, token_id], skip_special_tokens=True)
        text = after[len(before) :] if after.startswith(before) else dec([token_id])
        return text, text.encode()


def _as_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return bytes_token(raw)


def _raw_bytes_reader(tokenizer) -> Callable[[str], bytes] | None:
    """piece -> bytes for the tokenizer kinds whose pieces carry bytes; None for the others."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
    except (ValueError, AttributeError):  # an unusual backend: fall back to decoded text
        logger.debug("tokenizer decoder not readable; logprob bytes come from decoded text")
        return None
    if "ByteLevel" in kinds:
        table = _byte_decoder()
        return lambda piece: (
            bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
        )
    if kinds & {"ByteFallback", "Metaspace"}:
        return _sentencepiece_bytes
    return None


def _sentencepiece_bytes(piece: str) -> bytes:
    m = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or []:
        kinds |= _decoder_kinds(inner)
    return kinds


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
