"""Where the settings come from: the YAML file with ``OMNIGATE_`` environment overrides laid over it.

pydantic-settings merges its sources dict by dict, so a variable naming an entry of a list
(``OMNIGATE_ENGINES__0__API_KEY``) arrives as ``{"engines": {"0": {...}}}`` and would replace the
file's whole list, then fail as "not a valid list". :class:`EnvOverYaml` merges the two itself: a
mapping whose keys are all indexes updates those entries of the list beneath it (the next free index
appends one), and without a list beneath it becomes a list when its indexes run from 0 without a gap.
An index the file does not have fails the boot, naming the variable.
"""

from __future__ import annotations

from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

ENV_PREFIX = "OMNIGATE_"


def _variable(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + "__".join(path).upper()


def _indexed(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) and k.isdigit() for k in value)


def _first_leaf(value: Any, path: tuple[str, ...]) -> tuple[str, ...]:
    while isinstance(value, dict) and value:
        key = next(iter(value))
        path, value = (*path, key), value[key]
    return path


def _as_list(over: dict[str, Any], path: tuple[str, ...]) -> list[Any]:
    indexes = sorted(int(k) for k in over)
    if indexes != list(range(len(indexes))):
        missing = next(i for i in range(len(indexes) + 1) if i not in indexes)
        raise ValueError(
            f"{_variable((*path, str(missing)))} is missing: list entries set from the environment "
            "must be numbered from 0 without a gap"
        )
    return [merge(None, over[str(i)], (*path, str(i))) for i in indexes]


def merge(base: Any, over: Any, path: tuple[str, ...] = ()) -> Any:
    """``over`` (from the environment) laid over ``base`` (from the file); neither is changed."""
    if _indexed(over) and isinstance(base, list):
        out = list(base)
        for key in sorted(over, key=int):
            i = int(key)
            if i < len(out):
                out[i] = merge(out[i], over[key], (*path, key))
            elif i == len(out):
                out.append(merge(None, over[key], (*path, key)))
            else:
                raise ValueError(
                    f"{_variable(_first_leaf(over[key], (*path, key)))}: the configuration lists {len(base)} "
                    f"entries under {'.'.join(path)} (indexes from 0), so there is no entry {i} to set"
                )
        return out
    if _indexed(over) and base is None:
        return _as_list(over, path)
    if isinstance(over, dict) and isinstance(base, dict):
        out_d = dict(base)
        for key, value in over.items():
            out_d[key] = merge(base.get(key), value, (*path, key))
        return out_d
    if isinstance(over, dict):
        return {k: merge(None, v, (*path, k)) for k, v in over.items()}
    return over


class EnvOverYaml(PydanticBaseSettingsSource):
    """The environment source laid over the file source, lists merged by index (see the module)."""

    def __init__(
        self,
        settings_cls: type[BaseSettings],
        env: PydanticBaseSettingsSource,
        file: PydanticBaseSettingsSource | None,
    ) -> None:
        super().__init__(settings_cls)
        self._env = env
        self._file = file

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Unused: __call__ reads whole documents from the two sources it wraps.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        base = self._file() if self._file is not None else {}
        merged = merge(base, self._env())
        assert isinstance(merged, dict)
        return merged
