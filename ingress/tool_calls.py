"""Tool calling in chat: ``tools`` and ``tool_choice`` in, ``message.tool_calls`` out.

The chat template receives the tools (as Hugging Face templates take them), and how the answer is
read depends on ``tool_choice``:
- ``"auto"`` (the default with tools): the model decides. Its text is read for calls written as
  Hermes-style blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5,
  Hermes and other templates write them so); the text around the blocks is the message content.
  A stream sends content as it comes and holds back only what may be the start of a block.
- ``"required"``: the output is constrained by structured output to a JSON array of one or more
  ``{"name": <a tool>, "parameters": <its arguments>}`` (at most one with ``parallel_tool_calls:
  false``), so every call names a declared tool and its arguments follow its schema.
- a named function: the output is constrained to that function's arguments schema and is its one
  call.
- ``"none"``: no call is read, and the tools stay out of the prompt.
A choice that made calls finishes with ``finish_reason: "tool_calls"``. Streaming sends each call
as one delta (index, id, name and the whole arguments) once it is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from engine.sampling_params import StructuredOutput
from ingress.openai_protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ToolPlan:
    mode: str  # auto | required | named
    function: str | None = None  # the named function
    parallel: bool = True  # auto: keep every call (False: the first only)


def plan_tools(req) -> tuple[list[dict] | None, ToolPlan | None, StructuredOutput | None]:
    """(tools for the chat template, how to read the answer, the grammar that enforces it)."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None, None
    schemas = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise APIError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools"
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        schemas[name] = params
    if choice is None or choice == "auto":
        return tools, ToolPlan("auto", parallel=req.parallel_tool_calls is not False), None
    if choice == "none":
        return None, None, None
    if choice == "required":
        defs: dict = {}
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _rooted(schema, f"tool{k}", defs)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for k, (name, schema) in enumerate(schemas.items())
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if defs:
            array["$defs"] = defs
        if req.parallel_tool_calls is False:
            array["maxItems"] = 1
        return tools, ToolPlan("required"), _tools_grammar(array)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name is None:
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in schemas:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return tools, ToolPlan("named", name), _tools_grammar(schemas[name])


def _tools_grammar(schema: dict) -> StructuredOutput:
    try:
        return StructuredOutput("json_schema", json.dumps(schema))
    except ValueError as exc:  # a keyword generation cannot be held to, in a tool's parameters
        raise APIError(400, f"tools: {exc}", param="tools") from exc


def _rooted(schema: dict, key: str, defs: dict) -> dict:
    """``schema`` nested in a bigger one: where it refers to itself (``#``, ``#/$defs/...``,
    ``#/definitions/...``: pointers from its own root), it moves to the root's ``$defs`` under
    ``key`` and its references follow it, so they still point into it and not into the wrapper."""
    if not _has_local_ref(schema):
        return schema
    defs[key] = _rerooted(schema, f"#/$defs/{key}")
    return {"$ref": f"#/$defs/{key}"}


def _has_local_ref(node) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rerooted(node, root: str):
    if isinstance(node, list):
        return [_rerooted(v, root) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rerooted(v, root) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(message content, tool calls) read from a choice's whole text (a choice that ended on EOS or
    a stop condition; one cut short, or whose call is not whole JSON, is returned as text). Each
    call's arguments are the model's own text of them, not a re-encoding (which would round long
    numbers and could write ``Infinity``, which is no JSON)."""
    if plan.mode == "named":
        try:
            _DECODER.decode(text)
        except ValueError:  # cut (a stop string, max_tokens): nothing callable
            return text, []
        return None, [_call(plan.function, text.strip())]
    if plan.mode == "required":
        try:
            calls = [(c["name"], _member(body, "parameters")) for c, body in _elements(text)]
        except (ValueError, KeyError, TypeError, IndexError):  # cut short: nothing callable
            return text, []
        return None, [_call(name, args) for name, args in calls]
    head, sep, _ = text.partition(OPEN)
    if not sep:
        return text, []
    calls = []
    rest = text[len(head) :]
    while rest.startswith(OPEN):
        body, sep, rest = rest[len(OPEN) :].partition(CLOSE)
        try:
            call = _DECODER.decode(body)
            calls.append(_call(call["name"], _member(body, "arguments") if "arguments" in call else "{}"))
        except (ValueError, KeyError, TypeError, IndexError):
            return text, []  # not a well-formed call: the text stands as content
        rest = rest.lstrip()
    content = " ".join(part for part in (head.strip(), rest.strip()) if part) or None
    return content, calls if plan.parallel else calls[:1]


_DECODER = json.JSONDecoder()


def _elements(text: str) -> list[tuple[dict, str]]:
    """The objects of a JSON array's text, each with its own text; ValueError unless it is one."""
    items, body = [], text.strip()
    if not body.startswith("[") or not isinstance(_DECODER.decode(body), list):
        raise ValueError("not a JSON array")
    pos = _skip(body, 1)
    while body[pos] != "]":
        value, end = _DECODER.raw_decode(body, pos)
        if not isinstance(value, dict):
            raise ValueError("not an object")
        items.append((value, body[pos:end]))
        pos = _skip(body, end)
        if body[pos] == ",":
            pos = _skip(body, pos + 1)
    return items


def _member(obj: str, key: str) -> str:
    """The text of member ``key``'s value in the JSON object text ``obj``, as written."""
    body = obj.strip()
    pos = _skip(body, 1)
    while body[pos] != "}":
        name, pos = _DECODER.raw_decode(body, pos)
        pos = _skip(body, _skip(body, pos) + 1)  # past the colon
        _, end = _DECODER.raw_decode(body, pos)
        if name == key:
            return body[pos:end]
        pos = _skip(body, end)
        if body[pos] == ",":
            pos = _skip(body, pos + 1)
    raise KeyError(key)


def _skip(text: str, pos: int) -> int:
    while text[pos] in " \t\n\r":
        pos += 1
    return pos


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass(slots=True)
class ToolStream:
    """One streamed choice: the content that may go out now; the calls once the choice ends."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of text sent as content
    calls_seen: bool = field(default=False)

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.plan.mode != "auto" or self.calls_seen:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start != -1:
            self.calls_seen = True
            out, self.sent = self.text[self.sent : start], start
            return out
        # Hold back a tail that may be the start of the marker.
        end = len(self.text)
        for k in range(min(len(OPEN) - 1, end - self.sent), 0, -1):
            if OPEN.startswith(self.text[end - k :]):
                end -= k
                break
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self, finish_reason: str) -> tuple[str, list[dict]]:
        """(content not sent yet, calls) at the end of the choice; a choice cut short (``length``,
        ``abort``) makes no calls: its text is content."""
        content, calls = parse_tool_calls(self.plan, self.text) if finish_reason == "stop" else (None, [])
        if not calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        # The text after the calls, as the whole answer's content has it (the text before them went out).
        tail = self.text[self.sent :].rpartition(CLOSE)[2].strip() if self.plan.mode == "auto" else ""
        self.sent = len(self.text)
        sent_text = self.text[: self.text.find(OPEN)] if OPEN in self.text else ""
        gap = " " if tail and sent_text.strip() and not sent_text[-1:].isspace() else ""
        return (gap + tail if tail and content else ""), calls
