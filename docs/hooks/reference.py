"""An mkdocs hook: the reference pages are generated from the code at every build, so they cannot drift from it.

A page under docs/reference/ holds a line `<!-- reference: NAME -->`; the build replaces it with the markdown
NAME renders to:

- `cli`: every `sltune` command from `sltune.cli.main.parser()`: its description, usage, and each flag with its
  help (defaults as `sltune COMMAND -h` shows them);
- `spec`: the tuning spec from `TuningSpec.model_json_schema()`, a table per section;
- `settings`: `sltune.settings.Settings`, each field with its `SLTUNE_*` variable, default and description;
- `trial-result`: `TrialResult.model_json_schema()`, a table per object.
"""

from __future__ import annotations

import argparse
import json
import re

MARKER = re.compile(r"<!-- reference: ([\w-]+) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:     # noqa: ARG001 - mkdocs' hook signature
    return MARKER.sub(lambda m: RENDERERS[m.group(1)](), markdown)


def cell(text) -> str:
    """One table cell: on one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- the command line ---------------------------------------------------------------------------------------
def cli() -> str:
    from sltune.cli.main import _subcommands, parser

    top = parser()
    out = [f"```\n{top.format_usage().strip()}\n```\n", cell(top.description), ""]
    for name, sub in _subcommands(top).choices.items():
        out += [f"## sltune {name}\n", f"```\n{sub.format_usage().strip()}\n```\n"]
        if sub.description:
            out += [sub.description.strip(), ""]
        formatter = sub._get_formatter()
        rows = [(", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.metavar or a.dest}`",
                 formatter._expand_help(a) if a.help else "")
                for a in sub._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        out += ["| argument | help |", "| --- | --- |", *(f"| {flag} | {cell(text)} |" for flag, text in rows), ""]
    return "\n".join(out)


# -- pydantic models: the spec and the TrialResult --------------------------------------------------------------
def type_of(prop: dict) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{name.lower()})"
    if "enum" in prop:
        return " | ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "anyOf" in prop or "oneOf" in prop:
        return " or ".join(type_of(p) for p in prop.get("anyOf", prop.get("oneOf")))
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"list of {type_of(prop['items'])}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map to {type_of(prop['additionalProperties'])}"
    return kind


def schema_tables(schema: dict) -> str:
    """A table per object of a JSON schema: the root first, then its definitions."""
    objects = [(schema.get("title", "root"), schema), *schema.get("$defs", {}).items()]
    out = []
    for name, obj in objects:
        out += [f"## {name}\n"]
        if obj.get("description"):
            out += [cell(obj["description"]), ""]
        if "properties" not in obj:
            out += [f"`{type_of(obj)}`", ""]
            continue
        required = set(obj.get("required", ()))
        out += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for field, prop in obj["properties"].items():
            default = ("required" if field in required else f"`{json.dumps(prop['default'])}`" if "default" in prop
                       else "its fields' defaults" if "$ref" in prop else "")
            out.append(f"| `{field}` | {cell(type_of(prop))} | {cell(default)} | {cell(prop.get('description', ''))} |")
        out.append("")
    return "\n".join(out)


def spec() -> str:
    from sltune.tuning.spec import TuningSpec

    return schema_tables(TuningSpec.model_json_schema())


def trial_result() -> str:
    from sltune.profiling.schema import TrialResult

    return schema_tables(TrialResult.model_json_schema())


# -- settings ------------------------------------------------------------------------------------------------
def settings() -> str:
    from sltune.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    out = ["| variable | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        kind = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
        default = "required" if field.is_required() else f"`{field.get_default(call_default_factory=True)}`"
        # the anchor lets other pages link to one variable: settings.md#sltune_data_dir
        var = f"{prefix}{name}".upper()
        out.append(f'| <span id="{var.lower()}"></span>`{var}` | {cell(kind)} | {cell(default)} | '
                   f"{cell(field.description or '')} |")
    return "\n".join(out) + "\n"


RENDERERS = {"cli": cli, "spec": spec, "settings": settings, "trial-result": trial_result}
