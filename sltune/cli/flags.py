"""A model's fields as command-line flags, derived from their one declaration (sltune.config.RuntimeKnobs, the
backends' knobs, sltune.profiling.TrialSpec): the flag's name, its type or choices and its help come from the field,
as torchtitan's command line comes from its job config, so a knob added there is a flag of `profile` and `train` with
nothing else to edit."""

from __future__ import annotations

import argparse
import re
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo


def flag(name: str) -> str:
    """A field's flag: sub_batch_size -> --sub-batch-size."""
    return "--" + name.replace("_", "-")


def add_fields(parser: argparse._ActionsContainer, model: type[BaseModel], names: typing.Iterable[str], *,
               default: str = "{}", notes: dict[str, str] | None = None) -> None:
    """A flag per field, None unless given (the model applies its defaults, or a --config file its values): a bool
    field is --NAME/--no-NAME, a Literal its choices, a field read from text by the model (a byte size) its text as
    given. `default` words the default in the help ('{}': the field's; "the --config file's, else {}")."""
    for name in names:
        field = model.model_fields[name]
        shown = "none" if field.default is None else str(field.default).lower() if isinstance(field.default, bool) \
            else field.default
        text = "".join(filter(None, [field.description, (notes or {}).get(name)]))
        if field.default is not None or "(default" not in text:     # a backend's knob says what its backend uses
            text += f" (default: {default.format(shown)})"
        help_ = text.replace("%", "%%")
        kind, choices = _kind(field)
        if kind is bool:
            parser.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            parser.add_argument(flag(name), dest=name, type=kind, choices=choices, default=None, help=help_)


def given(args: argparse.Namespace, names: typing.Iterable[str]) -> dict[str, Any]:
    """The fields among `names` given on the command line."""
    return {name: value for name in names if (value := getattr(args, name, None)) is not None}


def reword(text: str, model: type[BaseModel], names: typing.Iterable[str]) -> str:
    """A refusal worded with the model's fields, worded with the flags instead: a field whose name is no English word
    (param_offload) wherever it stands, any other (schedule, device) where it names the field, before a colon or one
    of its values: 'param_offload disk: the resident schedule ...; use schedule canonical' reads '--param-offload
    disk: the resident schedule ...; use --schedule canonical'."""
    alternatives = []
    for name in sorted(names, key=len, reverse=True):
        _, values = _kind(model.model_fields[name])
        if "_" in name:
            alternatives.append(rf"{name}\b")
        else:
            after = "|".join(re.escape(str(v)) for v in values or ())
            alternatives.append(rf"{name}\b(?=:| (?:{after})\b)" if after else rf"{name}\b(?=:)")
    pattern = r"(?<![\w-])(?:" + "|".join(alternatives) + ")"
    return re.sub(pattern, lambda m: flag(m.group(0)), text)


def _kind(field: FieldInfo) -> tuple[type, tuple | None]:
    """argparse's type and choices for a field: its annotation without None; a Literal's values; str for a field
    the model reads from text (a BeforeValidator in its annotation, such as sltune.sizes.Bytes)."""
    annotation = field.annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Annotated:
        if any(isinstance(m, BeforeValidator) for m in annotation.__metadata__):
            return str, None
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        return type(values[0]), values
    if annotation in (bool, int, float, str):
        return annotation, None
    raise TypeError(f"{field}: no flag for a field of type {annotation}; declare it as bool, int, float, str, a "
                    "Literal or a byte size")
