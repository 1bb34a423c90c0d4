"""The base of every config model: camelCase keys, unknown keys rejected, immutable, and values run can use.

Checks every section gets, whoever writes it: no infinity or NaN (``1e999``
is parsed as infinity), no ``true``/``false`` where a number is expected
(pydantic would take ``true`` as 1), and no NUL byte in any string (every path
the kernel is given would fail on it).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import InitErrorDetails, PydanticCustomError

from nodeguard.bounded_json import bounded_json


class Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        arbitrary_types_allowed=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: object) -> object:
        # A model validator, not a field one: pydantic allows no "before" validator on a union's tag field.
        if not isinstance(data, Mapping):
            return data
        errors = []
        for name, field in cls.model_fields.items():
            key = field.alias if field.alias is not None and field.alias in data else name
            if key in data:
                where = _misplaced_bool(data[key], field.annotation)
                if where is not None:
                    errors.append(InitErrorDetails(type=_BOOL_ERROR, loc=(key, *where), input=_at(data[key], where)))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul_in_text(cls, value: object) -> object:
        if _has_nul(value):
            raise ValueError("must not contain a NUL byte")
        return value


Validator = TypeVar("Validator", bound=Callable[..., Any])
# How a tagged union's branches are named (pydantic's Tag): error paths leave them out, as they are no keys.
BRANCH = "branch:"
_RULES = "__config_rules__"


def cross_field(text: str, *keys: str) -> Callable[[Validator], Validator]:
    """Declare a rule across fields that the validator below checks: the configuration reference shows ``text``
    beside each of ``keys`` (the model's JSON keys). Innermost, right above the ``def``."""

    def mark(validator: Validator) -> Validator:
        setattr(validator, _RULES, ((text, keys), *getattr(validator, _RULES, ())))
        return validator

    return mark


def declared_rules(validator: Callable[..., Any]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The (text, keys) of each rule ``cross_field`` declared on a validator."""
    return tuple(getattr(validator, _RULES, ()))


def rules_of(model: type[BaseModel]) -> dict[str, list[str]]:
    """JSON key -> the rules across fields that the model's validators declare on it, in the order declared."""
    found: dict[str, list[str]] = {}
    decorators = model.__pydantic_decorators__
    validators = [d.func for d in decorators.field_validators.values()]
    validators += [d.func for d in decorators.model_validators.values()]
    for validator in validators:
        for text, keys in declared_rules(validator):
            for key in keys:
                found.setdefault(key, []).append(text)
    return found


class LazyModel(Model):
    """A Model whose validator is built when first used, not at import: for what a daemon may never validate
    (the gate's requests and state file when the gate is off), so starting it costs less."""

    model_config = ConfigDict(defer_build=True)


_BOOL_ERROR = PydanticCustomError("bool_not_number", "true/false given where a number or text is expected")
Where = tuple[int | str, ...]


def _at(value: Any, where: Where) -> Any:
    for step in where:
        value = value[step]
    return value


def _misplaced_bool(value: object, annotation: Any) -> Where | None:
    """Where a bool is (at the top, or inside a list or object) that the annotation does not take; None: nowhere."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _misplaced_bool(value, args[0])
    if origin is Union or origin is types.UnionType:
        fitting = args if isinstance(value, bool) else [m for m in args if _container_of(m, value)]
        found = [_misplaced_bool(value, member) for member in fitting]
        return found[0] if found and all(where is not None for where in found) else None
    if isinstance(value, bool):
        if annotation is bool or annotation is Any or annotation is object:
            return None
        return None if origin is Literal and any(isinstance(a, bool) for a in args) else ()
    if isinstance(value, list) and _container_of(annotation, value):
        item = args[0] if args else Any
        for index, element in enumerate(value):
            where = _misplaced_bool(element, item)
            if where is not None:
                return (index, *where)
    if isinstance(value, dict) and _container_of(annotation, value):
        item = args[1] if len(args) > 1 else Any
        for key, element in value.items():
            where = _misplaced_bool(element, item)
            if where is not None:
                return (key, *where)
    return None


def _container_of(annotation: Any, value: object) -> bool:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _container_of(get_args(annotation)[0], value)
    if isinstance(value, list):
        return isinstance(origin, type) and issubclass(origin, Sequence) and not issubclass(origin, str)
    if isinstance(value, dict):
        return isinstance(origin, type) and issubclass(origin, Mapping)
    return False


def _has_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list | tuple | set | frozenset):
        return any(_has_nul(v) for v in value)
    if isinstance(value, Mapping):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


def absolute_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("expected an absolute path")
    return value


def file_path(value: str) -> str:
    """An absolute path naming a file: not a directory ("/", "/run/"), no "." or ".." at its end."""
    absolute_path(value)
    if value.endswith("/") or PurePosixPath(value).name in ("", ".", ".."):
        raise ValueError("expected the path of a file, not of a directory")
    return value


AbsolutePath = Annotated[str, AfterValidator(absolute_path)]
FilePath = Annotated[str, AfterValidator(file_path)]


def _aliases() -> dict[str, str]:
    """Field name -> JSON key, for every config model."""
    aliases: dict[str, str] = {}
    pending: list[type[BaseModel]] = [Model]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        for name, field in cls.model_fields.items():
            aliases[name] = field.alias or name
    return aliases


def format_location(loc: Sequence[int | str]) -> str:
    """A validation error's location as the document's JSON path, e.g. ``perNode[1].guard.objectives[0]``."""
    # Pydantic reports a validated default by its Python name, not its JSON key.
    aliases = _aliases()
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            key = aliases.get(part, part) if "_" in part else part
            path += f".{key}" if path else key
    return path or "(document)"


def _message(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key missing"
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    return message


def format_errors(exc: ValidationError) -> list[str]:
    """One line per problem: ``path: what was expected, got value``."""
    lines = []
    for error in exc.errors(include_url=False):
        # Pydantic appends the failing branch of a union or a validator's name to
        # the location; they are not keys of the document.
        loc = [p for p in error["loc"] if isinstance(p, int) or not p.startswith(("function-", "union[", BRANCH))]
        line = f"{format_location(loc)}: {_message(error)}"
        if error["type"] != "missing" and error["input"] is not None:
            line += f", got {bounded_json(error['input'], 80)}"  # bounded: it may nest a thousand levels deep
        lines.append(line)
    return lines
