"""The reference pages, generated from the code while ``mkdocs build`` runs.

A mkdocs hook (``hooks:`` in mkdocs.yml): it writes four pages into the site
from what the code declares, so none of them can drift from it:

- ``reference/settings.md``: the settings catalogue (``dagnats.core.catalogue``),
  with the engine's defaults from ``EngineConfig``; the build fails when a
  ``DAGNATS_*`` variable the code reads is not in the catalogue, or the other
  way round;
- ``reference/cli.md``: every ``dagnats`` command's ``--help``, from the parser;
- ``reference/grpc.md``: every service, method, message, field and enum of
  ``proto/``, with its comments, from the compiled descriptors;
- ``reference/http.md``: every route of the gateway, from its OpenAPI document.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("core", "cli", "sdk", "services")
PROTO = ROOT / "proto"
VARIABLE = re.compile(r"\bDAGNATS_[A-Z0-9_]*[A-Z0-9]\b")


# Settings.


def variables_in_code() -> set[str]:
    """Every ``DAGNATS_*`` name the product's source mentions (tests aside)."""
    found: set[str] = set()
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if "_pb2" not in path.name:
                found.update(VARIABLE.findall(path.read_text()))
    return found


def settings_drift() -> list[str]:
    """What differs between the code's variables and the catalogue's."""
    from dagnats.core.catalogue import SETTINGS

    listed = {name for s in SETTINGS for name in s.names}
    code = variables_in_code()
    return [
        f"{name} is read by the code but not in dagnats.core.catalogue"
        for name in sorted(code - listed)
    ] + [
        f"{name} is in dagnats.core.catalogue but no code reads it"
        for name in sorted(listed - code)
    ]


def _engine_defaults() -> dict[str, str]:
    from dagnats.engine.config import ENV, EngineConfig

    config = EngineConfig()
    shown: dict[str, str] = {}
    for field, (env, kind) in ENV.items():
        value = getattr(config, field)
        if kind == "flag":
            text = "`true`" if value else "`false`"
        elif kind == "seconds":
            text = f"`{value:g}`"
            if value >= 86400 and value % 86400 == 0:
                text += f" ({value / 86400:g} days)"
        else:
            text = f"`{value}`"
        shown[env] = text
    return shown


def settings_page() -> str:
    from dagnats.core.catalogue import SETTINGS, TOPICS

    drift = settings_drift()
    if drift:
        raise SystemExit("the settings catalogue is out of date:\n  " + "\n  ".join(drift))
    engine = _engine_defaults()
    out = [
        "# Settings",
        "",
        "Every setting is an environment variable; a `dagnats serve` flag, where one "
        "is named, takes its place. A value that does not parse stops the process at "
        "start-up with a message naming the variable, never its value. Seconds are a "
        "positive number. This page is generated from `dagnats.core.catalogue` and "
        "the engine's `EngineConfig`.",
        "",
    ]
    for topic in TOPICS:
        out += [f"## {topic}", "", "| variable | default | meaning |", "|---|---|---|"]
        for s in SETTINGS:
            if s.topic != topic:
                continue
            names = ", ".join(f"`{n}`" for n in s.names)
            default = engine.get(s.names[0]) or (
                f"`{s.default}`" if s.default != "unset" else "unset"
            )
            meaning = s.meaning.replace("|", "\\|")
            out.append(f"| {names} | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


# The CLI.


def _commands(
    parser: argparse.ArgumentParser, path: list[str]
) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, [*path, name])


def cli_page() -> str:
    from dagnats.cli.main import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width
    out = [
        "# The `dagnats` command",
        "",
        "Every command and its options, from the command's own `--help` (generated "
        "from `dagnats.cli.main.build_parser`). Every command takes `--json`.",
        "",
    ]
    for path, parser in _commands(build_parser(), ["dagnats"]):
        out += [f"## `{' '.join(path)}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# The gRPC contracts.


def _descriptors() -> Any:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = [
            "protoc",
            f"-I{PROTO}",
            f"-I{include}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc could not compile proto/")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files


def _comments(file: Any) -> dict[tuple[int, ...], str]:
    found: dict[tuple[int, ...], str] = {}
    for loc in file.source_code_info.location:
        text = (loc.leading_comments or loc.trailing_comments).strip()
        if text:
            found[tuple(loc.path)] = _escape(text)
        if tuple(loc.path) == (4, 0) and loc.leading_detached_comments:
            found[()] = _escape("\n\n".join(loc.leading_detached_comments).strip())
    return found


def _escape(comment: str) -> str:
    """A proto comment as Markdown: its lines unindented, and ``<run>`` shown
    as written rather than taken for an HTML tag."""
    lines: list[str] = []
    for line in (raw.strip() for raw in comment.splitlines()):
        if line.startswith("- ") and lines and lines[-1] and not _in_list(lines):
            lines.append("")  # Markdown starts a list only after a blank line
        lines.append(line)
    return "\n".join(lines).replace("<", "&lt;").replace(">", "&gt;")


def _in_list(lines: list[str]) -> bool:
    """Whether the paragraph ``lines`` ends in is a list (its first line is an item)."""
    for line in reversed(lines):
        if not line:
            return False
        if line.startswith("- "):
            return True
    return False


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(field: Any) -> str:
    from google.protobuf.descriptor_pb2 import FieldDescriptorProto as F

    if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
        name = field.type_name.rsplit(".", 1)[-1]
    else:
        name = F.Type.Name(field.type).removeprefix("TYPE_").lower()
    if field.label == F.LABEL_REPEATED:
        name = f"repeated {name}"
    return f"`{name}`"


def _message(
    out: list[str], msg: Any, path: tuple[int, ...], notes: dict[tuple[int, ...], str], prefix: str
) -> None:
    name = f"{prefix}{msg.name}"
    out += [f"#### {name}", ""]
    if notes.get(path):
        out += [notes[path], ""]
    if msg.field:
        out += ["| field | type | number | meaning |", "|---|---|---|---|"]
        for i, field in enumerate(msg.field):
            note = _cell(notes.get((*path, 2, i), ""))
            out.append(f"| `{field.name}` | {_type_name(field)} | {field.number} | {note} |")
        out.append("")
    for i, enum in enumerate(msg.enum_type):
        _enum(out, enum, (*path, 4, i), notes, f"{name}.")
    for i, nested in enumerate(msg.nested_type):
        if not nested.options.map_entry:
            _message(out, nested, (*path, 3, i), notes, f"{name}.")


def _enum(
    out: list[str], enum: Any, path: tuple[int, ...], notes: dict[tuple[int, ...], str], prefix: str
) -> None:
    out += [f"#### {prefix}{enum.name} (enum)", ""]
    if notes.get(path):
        out += [notes[path], ""]
    out += ["| value | number | meaning |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        out.append(f"| `{value.name}` | {value.number} | {_cell(notes.get((*path, 2, i), ''))} |")
    out.append("")


def grpc_page() -> str:
    out = [
        "# gRPC contracts",
        "",
        "Every service, method, message, field and enum of the contracts in `proto/`, "
        "with their comments, generated from the compiled descriptors. A worker in "
        "another language generates its stubs from the same files "
        "([workers in other languages](../how-to/other-languages.md)).",
        "",
    ]
    for file in _descriptors().file:
        if file.name.startswith("google/"):
            continue
        notes = _comments(file)
        out += [f"## `{file.name}`", "", f"Package `{file.package}`.", ""]
        if notes.get(()):
            out += [notes[()], ""]
        for s, service in enumerate(file.service):
            out += [f"### service {service.name}", ""]
            if notes.get((6, s)):
                out += [notes[(6, s)], ""]
            out += ["| method | request | response | meaning |", "|---|---|---|---|"]
            for m, method in enumerate(service.method):
                req = ("stream " if method.client_streaming else "") + method.input_type.rsplit(
                    ".", 1
                )[-1]
                res = ("stream " if method.server_streaming else "") + method.output_type.rsplit(
                    ".", 1
                )[-1]
                note = _cell(notes.get((6, s, 2, m), ""))
                out.append(f"| `{method.name}` | `{req}` | `{res}` | {note} |")
            out.append("")
        if file.message_type or file.enum_type:
            out += ["### Messages", ""]
        for i, msg in enumerate(file.message_type):
            _message(out, msg, (4, i), notes, "")
        for i, enum in enumerate(file.enum_type):
            _enum(out, enum, (5, i), notes, "")
    return "\n".join(out)


# The HTTP API.


def openapi_document() -> dict[str, Any]:
    from dagnats.gateway import GatewayConfig
    from dagnats.gateway.app import create_app

    document: dict[str, Any] = create_app(GatewayConfig(engine_target="127.0.0.1:7233")).openapi()
    return document


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    return f"`{schema.get('type', 'any')}`"


def http_page() -> str:
    doc = openapi_document()
    out = [
        "# HTTP API",
        "",
        "Every route of the gateway, generated from its OpenAPI document (which a "
        "running gateway serves at `/openapi.json`, and shows at `/docs`).",
        "",
        doc.get("info", {}).get("description", ""),
        "",
    ]
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [f"**{op['summary']}**", ""]
            if op.get("description"):
                out += [op["description"], ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | meaning |", "|---|---|---|---|"]
                for p in params:
                    required = " (required)" if p.get("required") else ""
                    out.append(
                        f"| `{p['name']}`{required} | {p['in']} | "
                        f"{_schema_name(p.get('schema', {}))} | {_cell(p.get('description', ''))} |"
                    )
                out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                out += [f"Body: {_schema_name(body.get('schema', {}))}", ""]
            responses = op.get("responses", {})
            if responses:
                out += ["| status | body | meaning |", "|---|---|---|"]
                for status, response in responses.items():
                    schema = response.get("content", {}).get("application/json", {}).get("schema")
                    shape = _schema_name(schema) if schema else ""
                    out.append(f"| {status} | {shape} | {_cell(response.get('description', ''))} |")
                out.append("")
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
    for name, schema in schemas.items():
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [schema["description"], ""]
        props = schema.get("properties", {})
        if props:
            required = set(schema.get("required", []))
            out += ["| field | type | meaning |", "|---|---|---|"]
            for field, spec in props.items():
                mark = " (required)" if field in required else ""
                out.append(
                    f"| `{field}`{mark} | {_schema_name(spec)} | "
                    f"{_cell(spec.get('description', ''))} |"
                )
            out.append("")
    return "\n".join(out)


PAGES = {
    "reference/settings.md": settings_page,
    "reference/cli.md": cli_page,
    "reference/grpc.md": grpc_page,
    "reference/http.md": http_page,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    return files


if __name__ == "__main__":  # print one page: python docs/gen/reference.py reference/cli.md
    print(PAGES[sys.argv[1]]())
