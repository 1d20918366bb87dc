"""The configuration reference, rendered from the settings models and each policy's ``Config`` model.

The documentation site builds its reference page from :func:`settings_reference` and
:func:`policy_reference` (``docs/hooks/config_ref.py``), so the page cannot drift from what the gateway
validates; :func:`missing_descriptions` names the fields that would render without a meaning. It is
build-time code of the manual, beside its hook and outside the installed packages.
"""

from __future__ import annotations

import enum
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.settings import Settings
from gateway.settings_sources import ENV_PREFIX

#: pydantic-settings joins nested keys of an environment variable with this (Settings.model_config)
ENV_DELIMITER = "__"


@dataclass(frozen=True, slots=True)
class Row:
    """One key of the reference: a leaf value, or a model (a section) it holds."""

    key: str
    env: str | None
    type: str
    default: str
    description: str
    section: bool


def _unwrap(annotation: Any) -> Any:
    """The annotation without ``Annotated`` and without ``None`` in a union."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _model(annotation: Any) -> type[BaseModel] | None:
    a = _unwrap(annotation)
    return a if isinstance(a, type) and issubclass(a, BaseModel) else None


def _container(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """``("list", M)`` for a list of models, ``("dict", M)`` for a mapping to models, else None."""
    a = _unwrap(annotation)
    origin, args = get_origin(a), get_args(a)
    if origin is list and args and (m := _model(args[0])) is not None:
        return "list", m
    if origin is dict and len(args) == 2 and (m := _model(args[1])) is not None:
        return "dict", m
    return None


def _type_name(annotation: Any) -> str:
    a = _unwrap(annotation)
    origin, args = get_origin(a), get_args(a)
    if origin is Literal:
        return " \\| ".join(str(x) for x in args)
    if origin in (Union, types.UnionType):
        parts = [_type_name(x) for x in args if x is not type(None)]
        return " \\| ".join(parts)
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}" if len(args) == 2 else "map"
    if a is SecretStr:
        return "secret"
    if isinstance(a, type):
        if issubclass(a, PurePath):
            return "path"
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            a.__name__, a.__name__
        )
    return str(a)


def _bounds(field: FieldInfo) -> str:
    """The numeric bounds and patterns pydantic enforces on a field, also inside Optional[Annotated[...]]."""
    found: list[str] = []
    metadata = list(field.metadata)
    a = field.annotation
    for _ in range(4):
        if get_origin(a) is Annotated:
            metadata.extend(get_args(a)[1:])
            a = get_args(a)[0]
        elif get_origin(a) in (Union, types.UnionType):
            inner = [x for x in get_args(a) if x is not type(None)]
            if len(inner) != 1:
                break
            a = inner[0]
        else:
            break
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}
    for item in metadata:
        items = [item, *(getattr(item, "metadata", None) or [])]
        for m in items:
            for attr, sym in symbols.items():
                value = getattr(m, attr, None)
                if value is not None and not isinstance(value, FieldInfo):
                    found.append(f"{sym} {value}")
    return ", ".join(dict.fromkeys(found))


def _default(field: FieldInfo, name: str) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    return _show(value, bytes_=name.endswith("bytes"))


def _show(value: Any, bytes_: bool = False) -> str:
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, int | float) and not isinstance(value, bool):
        if bytes_ and isinstance(value, int) and value >= 1024 * 1024 and value % (1024 * 1024) == 0:
            mib = value // (1024 * 1024)
            return f"`{value}` ({mib // 1024} GiB)" if mib % 1024 == 0 else f"`{value}` ({mib} MiB)"
        return f"`{value}`"
    if isinstance(value, PurePath | str):
        text = str(value)
        return f"`{text}`" if text and text.isprintable() else f"`{json.dumps(text)}`"
    if isinstance(value, list | tuple):
        if not value:
            return "`[]`"
        if all(isinstance(v, BaseModel) for v in value):
            return f"{len(value)} {'entry' if len(value) == 1 else 'entries'}, see below"
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _description(field: FieldInfo, annotation: Any) -> str:
    if field.description:
        return " ".join(field.description.split())
    held = _model(annotation) or (c[1] if (c := _container(annotation)) else None)
    doc = held.__dict__.get("__doc__") if held is not None else None
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""


def walk(model: type[BaseModel], key: str = "", env: str | None = ENV_PREFIX) -> Iterator[Row]:
    """Every key under ``model``, depth first, in declaration order.

    ``key`` is the dotted path so far (``engines[].telemetry``), ``env`` the start of the environment
    variables beneath it (``OMNIGATE_ENGINES__<i>__TELEMETRY__``; ``None`` where no variable sets
    them). Lists of models show ``[]`` in the key and ``<i>`` in the variable; mappings to models show
    ``<name>`` in both. A row for a model (a section) names no variable: its keys are set one by one.
    """
    for name, field in model.model_fields.items():
        yaml_name = field.alias or name
        path = f"{key}.{yaml_name}" if key else yaml_name
        var = f"{env}{yaml_name.upper()}" if env is not None else None
        below = f"{var}{ENV_DELIMITER}" if var is not None else None
        annotation = field.annotation
        sub = _model(annotation)
        held = _container(annotation)
        description = _description(field, annotation)
        if sub is not None:
            yield Row(path, None, "section", "", description, True)
            yield from walk(sub, path, below)
        elif held is not None:
            kind, m = held
            yield Row(path, None, f"{kind} of {m.__name__}", _default(field, name), description, True)
            if kind == "list":
                yield from walk(m, f"{path}[]", f"{below}<i>{ENV_DELIMITER}" if below else None)
            else:
                yield from walk(m, f"{path}.<name>", f"{below}<NAME>{ENV_DELIMITER}" if below else None)
        else:
            bounds = _bounds(field)
            type_name = _type_name(annotation) + (f" ({bounds})" if bounds else "")
            yield Row(path, var, type_name, _default(field, name), description, False)


def leaf_keys(model: type[BaseModel] = Settings) -> list[str]:
    return [r.key for r in walk(model) if not r.section]


def policy_configs() -> dict[str, type[BaseModel]]:
    """Each installed policy's name and its ``Config`` model, in entry-point order."""
    from policies.registry import available_plugins, check_plugin

    plugins = available_plugins()
    return {name: check_plugin(name, plugins[name]).Config for name in plugins}


def missing_descriptions() -> list[str]:
    """The keys of the settings and of every policy config that have no description to render."""
    missing = [f"settings: {r.key}" for r in walk(Settings) if not r.description]
    for name, config in policy_configs().items():
        missing += [f"policy {name}: {r.key}" for r in walk(config, env=None) if not r.description]
    return missing


def _cell(text: str, escape_pipes: bool = True) -> str:
    text = text.replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|") if escape_pipes else text


def _table(rows: list[Row], with_env: bool) -> str:
    head = "| key | type | default | description |\n|---|---|---|---|\n"
    if with_env:
        head = "| key | environment variable | type | default | description |\n|---|---|---|---|---|\n"
    lines = []
    for r in rows:
        key = f"**`{r.key}`**" if r.section else f"`{r.key}`"
        cells = [key]
        if with_env:
            cells.append(f"`{r.env}`" if r.env else "")
        cells += [_cell(r.type, escape_pipes=False), r.default, _cell(r.description)]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def settings_reference() -> str:
    """Markdown: one table per top-level section of :class:`gateway.settings.Settings`."""
    out: list[str] = []
    for name, field in Settings.model_fields.items():
        rows = [
            r
            for r in walk(Settings)
            if r.key.startswith((f"{name}.", f"{name}[")) or (r.key == name and r.type != "section")
        ]
        intro = _description(field, field.annotation)
        out.append(f"### `{name}`\n\n{intro}\n\n{_table(rows, with_env=True)}")
    return "\n".join(out)


def policy_reference(name: str | None = None) -> str:
    """Markdown: the ``config:`` keys of one policy (or of every installed one, each under a heading)."""
    configs = policy_configs()
    chosen = {name: configs[name]} if name is not None else configs
    out: list[str] = []
    for policy, config in chosen.items():
        rows = list(walk(config, env=None))
        body = _table(rows, with_env=False) if rows else "This policy takes no configuration.\n"
        out.append(body if name is not None else f"### `{policy}`\n\n{body}")
    return "\n".join(out)
