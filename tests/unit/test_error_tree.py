"""The error tree drawn in ``core/errors.py``'s docstring is the tree the classes make.

The tree is rendered from ``OmnigateError.__subclasses__()``, walked depth first with each
class's children in the order they are defined, one line per class: its status, OpenAI
``type`` and ``code`` (``-`` where the class has none), and the module of a class defined
outside ``core.errors``. Every module of the project that subclasses an error class is
imported first (found by reading the sources), so a class added anywhere shows up.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import core.errors
from core.errors import OmnigateError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "gateway", "engines", "policies", "observability")
NAME_WIDTH = 36
TYPE_WIDTH = 23
CODE_WIDTH = 24


def _import_subclassing_modules() -> None:
    """Import every project module with a class whose base is an error class (to a fixed point)."""
    names = {cls.__name__ for cls in _walk(OmnigateError)}
    sources = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    classes: dict[Path, list[tuple[str, set[str]]]] = {}
    for path in sources:
        tree = ast.parse(path.read_text(), str(path))
        classes[path] = [
            (node.name, {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases})
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
        ]
    modules: set[str] = set()
    grew = True
    while grew:
        grew = False
        for path, defs in classes.items():
            for name, bases in defs:
                if bases & names and name not in names:
                    names.add(name)
                    modules.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
                    grew = True
    for module in sorted(modules):
        importlib.import_module(module.removesuffix(".__init__"))


def _walk(cls: type) -> list[type]:
    out = [cls]
    for sub in _children(cls):
        out += _walk(sub)
    return out


def _children(cls: type) -> list[type]:
    subs = [s for s in cls.__subclasses__() if not s.__module__.startswith("tests")]
    return sorted(
        subs, key=lambda s: (s.__module__ != "core.errors", s.__module__, inspect.getsourcelines(s)[1])
    )


def _line(cls: type) -> str:
    where = "" if cls.__module__ == "core.errors" else f"  [{cls.__module__}]"
    return f"{cls.status} {cls.type:<{TYPE_WIDTH}}{cls.code or '-':<{CODE_WIDTH}}".rstrip() + where


def render() -> list[str]:
    lines = [f"{'OmnigateError':<{NAME_WIDTH}}{_line(OmnigateError)}"]

    def branch(cls: type, indent: str) -> None:
        subs = _children(cls)
        for i, sub in enumerate(subs):
            last = i == len(subs) - 1
            head = f"{indent}{'└── ' if last else '├── '}{sub.__name__}"
            lines.append(f"{head:<{NAME_WIDTH}}{_line(sub)}".rstrip())
            branch(sub, indent + ("    " if last else "│   "))

    branch(OmnigateError, "")
    return lines


def drawn() -> list[str]:
    """The tree block of the module docstring: from the ``OmnigateError`` line to the next blank line."""
    doc = core.errors.__doc__ or ""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    OmnigateError "))
    block = []
    for line in lines[start:]:
        if not line.strip():
            break
        block.append(line.removeprefix("    "))
    return block


def test_the_docstring_draws_every_error_class_once_where_it_is():
    _import_subclassing_modules()
    rendered = render()
    expected = "\n".join("    " + x for x in rendered)
    assert drawn() == rendered, "core/errors.py's tree should read:\n" + expected


def test_every_error_class_appears_once_in_the_tree():
    _import_subclassing_modules()
    names = [cls.__name__ for cls in _walk(OmnigateError) if not cls.__module__.startswith("tests")]
    assert len(names) == len(set(names))
    assert {"KeyRefused", "DecoderFailed", "MediaTooLarge", "EngineProtocolError"} <= set(names)
