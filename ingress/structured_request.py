"""The request fields that ask for structured output, as one ``StructuredOutput`` (or a 400 naming the
field): OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``.

The ingress checks the shape of what was asked (one kind at a time, a schema that is a JSON object, a
choice list of strings); whether a schema or regex compiles is up to the grammar engine on the
workers, which refuse one they cannot compile before queueing it (a 400 with the reason).
"""

from __future__ import annotations

import json

from engine.sampling_params import StructuredOutput
from ingress.openai_protocol import APIError

MAX_SPEC_CHARS = 64 << 10  # a schema, regex or grammar's text


def structured_output(req) -> StructuredOutput | None:
    asked: list[tuple[str, str, str]] = []  # (param, kind, value)
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            asked.append(("response_format", "json_object", ""))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "response_format.json_schema.schema must be a JSON object", param="response_format"
                )
            asked.append(("response_format", "json_schema", json.dumps(schema)))
        elif kind != "text":
            raise APIError(
                400,
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                param="response_format",
            )
    if req.guided_json is not None:
        schema = req.guided_json if isinstance(req.guided_json, dict) else _json_object(req.guided_json)
        asked.append(("guided_json", "json_schema", json.dumps(schema)))
    if req.guided_regex is not None:
        asked.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        asked.append(("guided_choice", "choice", json.dumps(req.guided_choice)))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", "grammar", req.guided_grammar))
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(
            400,
            f"ask for one structured output at a time, got {', '.join(a[0] for a in asked)}",
            param=asked[1][0],
        )
    param, kind, value = asked[0]
    if len(value) > MAX_SPEC_CHARS:
        raise APIError(400, f"{param} is over {MAX_SPEC_CHARS} characters", param=param)
    if req.ignore_eos:
        raise APIError(
            400, "structured output ends on EOS: ignore_eos cannot be set with it", param="ignore_eos"
        )
    try:
        return StructuredOutput(kind, value)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc


def structured_param(req) -> str | None:
    """The request field that asks for structured output (checked by ``structured_output``)."""
    rf = req.response_format
    if rf is not None and rf.get("type") in ("json_object", "json_schema"):
        return "response_format"
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return None


def _json_object(text: str) -> dict:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (nested past the parser's recursion limit)
        raise APIError(400, f"guided_json is not valid JSON: {exc}", param="guided_json") from None
    if not isinstance(schema, dict):
        raise APIError(400, "guided_json must be a JSON schema object", param="guided_json")
    return schema
