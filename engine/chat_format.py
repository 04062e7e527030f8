"""Chat messages as chat templates take them, the same for ``LLM.chat`` and ``/v1/chat/completions``
(``ingress.openai_protocol.ChatMessage.for_template``), so both render one prompt from one
conversation.

- ``content`` given as OpenAI's parts (``[{"type": "text", "text": ...}]``) is joined into one
  string; ``None`` is the empty string (an assistant message that only made calls).
- An earlier call's ``arguments`` (a JSON string, as OpenAI's clients send them) is the object it
  encodes, as vLLM passes it: templates write it with ``tojson`` (Qwen 2.5's, Llama 3.1's), and a
  string would be encoded twice.

NOTE: torch-free; the ingress imports it.
"""

from __future__ import annotations

import json
from typing import Any


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """``msg`` (an OpenAI chat message) for a chat template; ``ValueError`` for content parts that
    are not text."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"a message must be an object with a role, got {msg!r}")
    out = {**msg, "content": content_text(msg.get("content"))}
    if msg.get("tool_calls"):
        out["tool_calls"] = [decoded_arguments(c) for c in msg["tool_calls"]]
    return out


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(f"only text content parts are supported, got {part!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"a message's content must be a string or a list of text parts, got {content!r}")


def decoded_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        decoded = json.loads(args)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's recursion limit:
        return call  # the template gets the text as sent
    return {**call, "function": {**fn, "arguments": decoded}}
