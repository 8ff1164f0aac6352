"""Generates values.schema.json from values.yaml, whose `# --` comments are the one source of key documentation.

Rules: a mapping without its own `# --` comment is a group (its keys are listed, unknown keys refused); every other
key must carry a `# --` comment (a missing one is an error), and its default sets its type. A documented mapping is
free-form (resources, nodeSelector, ...). `(one of: a | b)` in a comment becomes an enum, `(minimum: N)` a lower
bound; keys ending in `port`/`Port` are 1-65535. Run `python helm/kimiserve/schema.py` after editing values.yaml;
tests/deploy checks it is fresh.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parent
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_][A-Za-z0-9_.\-/]*):(?:\s|$)")
ENUM = re.compile(r"\(one of: ([^)]*)\)")
MINIMUM = re.compile(r"\(minimum: (-?[0-9]+(?:\.[0-9]+)?)\)")
TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def doc_comments(text: str) -> dict[tuple[str, ...], str]:
    """Maps each key path to the `# --` comment (and its continuation lines) right above it."""
    docs: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and pending is not None:
            pending.append(stripped[1:].strip())
            continue
        m = KEY_LINE.match(line)
        if not m:
            if stripped and not stripped.startswith("#"):
                pending = None if not stripped.startswith("-") else pending
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m["key"]))
        if pending is not None:
            docs[tuple(k for _, k in stack)] = " ".join(pending)
        pending = None
    return docs


def node(value, path: tuple[str, ...], docs: dict) -> dict:
    doc = docs.get(path)
    if isinstance(value, dict) and doc is None:
        props = {k: node(v, path + (k,), docs) for k, v in value.items()}
        return {"type": "object", "additionalProperties": False, "properties": props}
    if doc is None:
        raise SystemExit(f"values.yaml: key {'.'.join(path)} has no `# --` documentation comment")
    out: dict = {"description": doc}
    if value is not None:
        out["type"] = "number" if type(value) is float else TYPES[type(value)]
    if type(value) is int and path[-1].lower().endswith("port"):
        out.update(minimum=1, maximum=65535)
    if m := ENUM.search(doc):
        out["enum"] = [v.strip() for v in m[1].split("|")]
    if m := MINIMUM.search(doc):
        out["minimum"] = float(m[1]) if "." in m[1] else int(m[1])
    return out


def generate() -> str:
    text = (CHART / "values.yaml").read_text()
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "kimiserve chart values",
              **node(yaml.safe_load(text), (), doc_comments(text))}
    return json.dumps(schema, indent=2) + "\n"


if __name__ == "__main__":
    out = CHART / "values.schema.json"
    out.write_text(generate())
    sys.stdout.write(f"wrote {out}\n")
