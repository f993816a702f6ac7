"""Closing a JSON schema's objects and tuples before it becomes a grammar: properties and
items the schema does not describe are not generated. Pure and torch-free: the router applies
it to tool parameters (`router.http.tools`), `model_runtime.structured` to ``json``
constraints, so both sides compile the same grammar.

A schema object without ``additionalProperties`` allows any other property with any value,
and a model left free to add properties can write free text into them forever (SmolLM2-135M,
greedy, asked for ``{"name": ...}`` in an open object, wrote a 390-token "description" that
repeated one sentence). xgrammar's ``strict_mode`` (its default; xgrammar is vLLM's and
SGLang's default grammar backend) generates no property and no item the schema does not
specify; OpenAI's strict mode requires
every object to say ``additionalProperties: false``. `closed` does the same where the schema
leaves it open, and only where that keeps the schema's meaning otherwise: every output it
allows is valid against the original schema.

A node gets ``additionalProperties: false`` when it describes objects (``type`` object, or
``properties`` without a ``type``), says nothing about additional or unevaluated properties,
requires only properties it lists (and ``minProperties`` no more than it lists), and nothing
else constrains the same instance: it has no ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref`` /
``if`` / ``then`` / ``else`` / ``dependentSchemas`` of its own, and it is not a branch of one
whose parent has object keywords (an ``allOf`` branch never: branches intersect), nor a
``$defs`` entry referenced from such a place, nor a property schema of an object with
``patternProperties`` (both may apply to one value). A tuple (``prefixItems`` without
``items``) gets ``items: false`` under the same conditions, unless ``minItems`` or
``contains`` asks for more. A schema that refers anywhere but ``#``, ``#/$defs/…`` or
``#/definitions/…``, or uses ``$id`` below the root, ``$anchor`` or dynamic references, is
left as it is. Schemas under ``not`` and ``if`` are conditions, never closed.
"""

from __future__ import annotations

import copy
from typing import Any

_IN_PLACE = ("allOf", "anyOf", "oneOf", "then", "else", "dependentSchemas")
"""Applicators whose subschemas constrain the same instance as their parent (``if`` and
``not`` too, but they are conditions: never closed)."""
_CONDITIONS = ("not", "if")
_OBJECT_WORDS = frozenset(
    {
        "properties",
        "patternProperties",
        "additionalProperties",
        "unevaluatedProperties",
        "required",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependentRequired",
    }
)
_ARRAY_WORDS = frozenset(
    {"items", "prefixItems", "unevaluatedItems", "contains", "minItems", "maxItems"}
)
_SHARING = _OBJECT_WORDS | _ARRAY_WORDS | frozenset(_IN_PLACE) | frozenset(_CONDITIONS)
"""A node with any of these constrains the instance that its `$ref` target also does."""
_DEFS = ("$defs", "definitions")
_UNSAFE_WORDS = ("$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef")


class _Unsafe(Exception):
    """The schema uses references, identifiers or conditions this module does not track."""


def closed(schema: Any) -> Any:
    """A copy of `schema` (a parsed JSON schema) with its open objects and tuples closed
    where that keeps its meaning (module docstring); `schema` itself is not modified.

    Steps: 1. count every reference to each target anywhere in the document (`_refs`, which
    also refuses what is not tracked); 2. walk the subschemas, counting the references made
    from a place whose instance nothing else constrains ("clean"), with the targets found
    shared so far; a target with a reference that is not clean is shared; repeat until no
    new target is shared; 3. walk once more, closing every node that is not shared."""
    if not isinstance(schema, dict):
        return schema
    out = copy.deepcopy(schema)
    try:
        everywhere: dict[str, int] = {}
        _refs(out, "#", everywhere)
        shared: set[str] = set()
        while True:
            clean: dict[str, int] = {}
            _walk(out, "#", "#" in shared, shared, clean, close=False)
            now = {t for t, n in everywhere.items() if clean.get(t, 0) != n}
            if now <= shared:
                break
            shared |= now
        _walk(out, "#", "#" in shared, shared, {}, close=True)
    except _Unsafe:
        return schema
    return out


def _refs(value: Any, path: str, counts: dict[str, int]) -> None:
    """Count the references in `value` (every dict anywhere, data included: a count too many
    only keeps a target open); raise _Unsafe for what is not tracked."""
    if isinstance(value, list):
        for v in value:
            _refs(v, path, counts)
        return
    if not isinstance(value, dict):
        return
    if any(w in value for w in _UNSAFE_WORDS) or ("$id" in value and path != "#"):
        raise _Unsafe
    ref = value.get("$ref")
    if isinstance(ref, str):
        name = next((ref[len(f"#/{d}/") :] for d in _DEFS if ref.startswith(f"#/{d}/")), None)
        if ref != "#" and (name is None or "/" in name or "~" in name):
            raise _Unsafe
        counts[ref] = counts.get(ref, 0) + 1
    for word in _CONDITIONS:
        if word in value and _mentions_ref(value[word]):
            raise _Unsafe  # narrowing what a condition refers to would widen the schema
    for key, v in value.items():
        _refs(v, f"{path}/{key}", counts)


def _mentions_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_mentions_ref(v) for v in value.values())
    return isinstance(value, list) and any(_mentions_ref(v) for v in value)


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _close(node: dict[str, Any]) -> None:
    """Close `node` itself (the caller checked that nothing else shares its instance);
    malformed keywords leave it open (the grammar engine refuses them)."""
    if "$ref" in node or any(w in node for w in _IN_PLACE + _CONDITIONS):
        return
    types = _types(node)
    props = node.get("properties", {})
    required = _names(node.get("required", []))
    dependent = node.get("dependentRequired", {})
    least = node.get("minProperties", 0)
    if (
        ("object" in types or (not types and "properties" in node))
        and isinstance(props, dict)
        and not any(
            w in node
            for w in ("additionalProperties", "unevaluatedProperties", "patternProperties")
        )
        and required is not None
        and required <= set(props)
        and isinstance(dependent, dict)
        and set(dependent) <= set(props)
        and isinstance(least, int)
        and least <= len(props)
    ):
        node["additionalProperties"] = False
    prefix = node.get("prefixItems")
    least = node.get("minItems", 0)
    if (
        isinstance(prefix, list)
        and not any(w in node for w in ("items", "unevaluatedItems", "contains"))
        and isinstance(least, int)
        and least <= len(prefix)
    ):
        node["items"] = False


def _names(value: Any) -> set[str] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return set(value)
    return None


def _walk(
    node: Any, path: str, shared: bool, targets: set[str], clean: dict[str, int], close: bool
) -> None:
    """Visit `node` (at JSON pointer `path`; `shared`: something else constrains its
    instance) and its subschemas: count its reference in `clean` when it is clean, and close
    it when `close` and not `shared`. Conditions (``not``, ``if``) are not entered."""
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and not shared and not any(w in node for w in _SHARING):
        clean[ref] = clean.get(ref, 0) + 1
    if close and not shared:
        _close(node)

    def visit(sub: Any, where: str, sub_shared: bool) -> None:
        _walk(sub, where, sub_shared, targets, clean, close)

    for word in _IN_PLACE:
        value = node.get(word)
        subs = value.values() if isinstance(value, dict) else _list(value)
        # an anyOf / oneOf branch is the instance's alternative: it is shared only when
        # something beside it constrains the instance; other applicators' subschemas always are
        beside = any(w in node for w in _SHARING | {"$ref"} if w != word)
        for i, sub in enumerate(subs):
            visit(sub, f"{path}/{word}/{i}", shared or beside or word not in ("anyOf", "oneOf"))
    patterned = "patternProperties" in node
    for name, sub in _dict(node.get("properties")).items():
        visit(sub, f"{path}/properties/{name}", patterned)
    for name, sub in _dict(node.get("patternProperties")).items():
        visit(sub, f"{path}/patternProperties/{name}", True)
    for word in ("additionalProperties", "contains"):
        visit(node.get(word), f"{path}/{word}", False)
    for word in ("items", "prefixItems"):
        value = node.get(word)
        for i, sub in enumerate(_list(value)):
            visit(sub, f"{path}/{word}/{i}", False)
        visit(value, f"{path}/{word}", False)
    for d in _DEFS:
        for name, sub in _dict(node.get(d)).items():
            where = f"{path}/{d}/{name}"
            visit(sub, where, where in targets)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
