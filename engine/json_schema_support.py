"""The JSON-schema keywords structured output cannot hold generation to, refused before a request
runs (a 400 at the edge) instead of silently producing output the schema rejects.

The grammar engine (xgrammar 0.2) compiles a schema into a grammar the sampler follows; these
keywords compile without error but are not enforced (each measured: a string the schema rejects is
accepted by the grammar). vLLM refuses the same ones up front.

- ``not``, ``if`` / ``then`` / ``else``, ``contains`` / ``minContains`` / ``maxContains``,
  ``uniqueItems: true``, ``dependentRequired``, ``dependentSchemas``, ``dependencies``,
  ``unevaluatedProperties``, ``unevaluatedItems``, ``$dynamicRef``, ``$recursiveRef``;
- ``allOf`` with more than one schema (one is the schema itself);
- ``multipleOf`` but on an integer by an integer;
- a ``$ref`` outside the document (only ``#...`` resolves);
- a ``required`` name that ``properties`` does not declare;

and subschemas nested more than ``MAX_DEPTH`` deep (their grammar's compile time).

NOTE: torch-free and xgrammar-free; the ingress imports it.
"""

from __future__ import annotations

from typing import Any

_UNENFORCED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# Subschemas nested deeper than this are refused: xgrammar's compile time grows steeply with depth
# (measured: 100 levels 0.15 s, 200 levels 1.1 s, 450 levels 10 s, 900 levels 38 s), and it runs
# under the workers' one compile lock, so one such request stalled every structured request there.
MAX_DEPTH = 32
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "propertyNames", "additionalItems")


def check_schema(schema: Any, where: str = "#", depth: int = 0) -> None:
    """Raise ``ValueError`` naming the first keyword (and its place in ``schema``) that generation
    could not be held to, or the place where subschemas nest deeper than ``MAX_DEPTH``."""
    if not isinstance(schema, dict):
        return  # true / false, or a value the grammar engine refuses by itself
    if depth > MAX_DEPTH:
        raise ValueError(
            f"JSON schema at {where} nests subschemas more than {MAX_DEPTH} deep: compiling its grammar "
            "takes time that grows steeply with depth"
        )
    for key in schema:
        if key in _UNENFORCED:
            _refuse(key, where)
    if schema.get("uniqueItems") is True:
        _refuse("uniqueItems", where)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _refuse("allOf", where, "with more than one schema")
    step = schema.get("multipleOf")
    if step is not None and not (schema.get("type") == "integer" and isinstance(step, int)):
        _refuse("multipleOf", where, "but on an integer by an integer")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        _refuse("$ref", where, f"outside the document ({ref!r})")
    required, declared = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not isinstance(declared, dict) or r not in declared]
        if missing:
            raise ValueError(
                f"JSON schema at {where}: required property {missing[0]!r} is not declared in "
                "'properties', so generation cannot be made to write it"
            )
    for name in _SCHEMA_MAPS:
        if isinstance(schema.get(name), dict):
            for k, sub in schema[name].items():
                check_schema(sub, f"{where}/{name}/{k}", depth + 1)
    for name in _SCHEMA_LISTS:
        if isinstance(schema.get(name), list):
            for i, sub in enumerate(schema[name]):
                check_schema(sub, f"{where}/{name}/{i}", depth + 1)
    for name in _SCHEMAS:
        check_schema(schema.get(name), f"{where}/{name}", depth + 1)


def _refuse(keyword: str, where: str, which: str = "") -> None:
    what = f"{keyword!r} {which}".strip()
    raise ValueError(
        f"JSON schema keyword {what} at {where} is not supported: structured output could not hold "
        "the output to it"
    )
