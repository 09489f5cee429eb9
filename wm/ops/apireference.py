"""The documentation's HTTP reference, generated from the admin API's own OpenAPI description.

``python -m wm.ops.apireference docs/reference/http.md`` (the default file) rewrites the part
of that page between the two markers below from what ``/openapi.json`` serves: every call
(its parameters, body and answers) and every model. ``tests/test_docs.py`` fails when that
part differs from what this renders, so the page cannot drift from the API. Building the
description opens no connection: the application is made on default settings and never run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The page the reference lives in, from the root of the clone.
PAGE = "docs/reference/http.md"
BEGIN = f"<!-- wm-api:begin (python -m wm.ops.apireference {PAGE}) -->"
END = "<!-- wm-api:end -->"
METHODS = ("get", "put", "post", "patch", "delete")


def openapi() -> dict[str, Any]:
    """The admin API's OpenAPI description, as ``GET /openapi.json`` answers it."""
    from wm.config import Settings
    from wm.ops.api import create_app

    return create_app(Settings.from_env({})).openapi()


def _text(value: str | None) -> str:
    """A docstring's text for one Markdown table cell or paragraph: reST's double backticks
    as Markdown's, lines joined, bars escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", value or "")
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(name: str) -> str:
    return f"[`{name}`](#schema-{name.lower()})"


def _type(schema: dict[str, Any]) -> str:
    """A schema in a few words: ``string or null``, ``list of `WorkerInfo```…"""
    if "$ref" in schema:
        return _anchor(schema["$ref"].rsplit("/", 1)[1])
    if "anyOf" in schema:
        return " or ".join(_type(part) for part in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{value}`" for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return "list of " + _type(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "object of " + _type(schema["additionalProperties"])
    return f"{kind} ({schema['format']})" if "format" in schema else str(kind)


def _parameters(operation: dict[str, Any]) -> Iterator[str]:
    parameters = operation.get("parameters", [])
    if parameters:
        yield "| parameter | in | type | required | meaning |"
        yield "|---|---|---|---|---|"
    for p in parameters:
        meaning = _text(p.get("description") or p["schema"].get("description"))
        required = "yes" if p.get("required") else "no"
        yield f"| `{p['name']}` | {p['in']} | {_type(p['schema'])} | {required} | {meaning} |"


def _body(operation: dict[str, Any]) -> Iterator[str]:
    body = operation.get("requestBody")
    if body:
        schema = body["content"]["application/json"]["schema"]
        required = "" if body.get("required") else " (optional)"
        yield f"Body{required}: {_type(schema)}."


def _answers(operation: dict[str, Any]) -> Iterator[str]:
    """The answers that succeed, one row each; the errors on one line, by the body they carry."""
    errors: dict[str, list[str]] = {}
    yield "| status | meaning | body |"
    yield "|---|---|---|"
    for status, answer in sorted(operation["responses"].items()):
        schema = answer.get("content", {}).get("application/json", {}).get("schema")
        shown = _type(schema) if schema else "-"
        if status.startswith("2"):
            yield f"| {status} | {_text(answer.get('description'))} | {shown} |"
        else:
            errors.setdefault(shown, []).append(status)
    yield ""
    yield (
        "Errors: "
        + "; ".join(f"{', '.join(codes)}: {body}" for body, codes in errors.items())
        + "."
    )


def _operation(path: str, method: str, operation: dict[str, Any]) -> Iterator[str]:
    yield f"### `{method.upper()} {path}`"
    yield ""
    yield f"**{operation.get('summary', '')}.** {_text(operation.get('description'))}".rstrip()
    yield ""
    if not operation.get("security"):
        yield "Needs no token."
        yield ""
    for part in (_parameters, _body, _answers):
        lines = list(part(operation))
        yield from [*lines, ""] if lines else []


def _calls(description: dict[str, Any]) -> Iterator[str]:
    """Every operation under a heading per tag, tags in the order the API lists them."""
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, operations in description["paths"].items():
        for method in (m for m in METHODS if m in operations):
            operation = operations[method]
            tag = (operation.get("tags") or ["other"])[0]
            by_tag.setdefault(tag, []).append((path, method, operation))
    for tag, operations in by_tag.items():
        yield f"## Calls: {tag}"
        yield ""
        for path, method, operation in operations:
            yield from _operation(path, method, operation)


def _schemas(description: dict[str, Any]) -> Iterator[str]:
    """Every model the calls take or answer, alphabetically, with its fields."""
    yield "## Schemas"
    yield ""
    for name, schema in sorted(description["components"]["schemas"].items()):
        yield f"### Schema `{name}`"
        yield ""
        if schema.get("description"):
            yield _text(schema["description"])
            yield ""
        fields = schema.get("properties", {})
        if not fields:
            yield f"A {_type(schema)}."
            yield ""
            continue
        required = set(schema.get("required", []))
        yield "| field | type | required | meaning |"
        yield "|---|---|---|---|"
        for field, value in fields.items():
            need = "yes" if field in required else "no"
            yield f"| `{field}` | {_type(value)} | {need} | {_text(value.get('description'))} |"
        yield ""


def render(description: dict[str, Any] | None = None) -> str:
    """The reference as Markdown: the calls by tag, then the schemas."""
    description = openapi() if description is None else description
    lines = [BEGIN, "", *_calls(description), *_schemas(description), END]
    return "\n".join(lines)


def replace(page: str, description: dict[str, Any] | None = None) -> str:
    """``page`` with its reference part rendered anew."""
    head, found, rest = page.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"the page has no {BEGIN!r} … {END!r} part")
    return head + render(description) + rest.split(END, 1)[1]


def main(argv: list[str]) -> int:
    """Render the reference into the page named by ``argv`` (default :data:`PAGE`)."""
    path = Path(argv[0] if argv else PAGE)
    path.write_text(replace(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
