"""Build-time pieces of the manual: the configuration reference and the error tree, made from the code.

A page asks for one with a marker on a line of its own:

- ``<!-- config-reference: settings -->``: every key of ``gateway.settings.Settings``;
- ``<!-- config-reference: policy NAME -->``: the ``config:`` keys of one installed policy;
- ``<!-- error-tree -->``: the classes of ``core.errors`` with their status, type and code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

MARKER = re.compile(
    r"^<!-- (config-reference: settings|config-reference: policy [a-z0-9-]+|error-tree) -->$", re.M
)


def on_config(config: Any) -> Any:
    # The repository root, so the build imports the code beside mkdocs.yml, not an installed copy.
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def _error_tree() -> str:
    from core import errors

    lines: list[str] = []

    def visit(cls: type, depth: int) -> None:
        code = getattr(cls, "code", None)
        status = getattr(cls, "status", "")
        label = f"{cls.__name__}".ljust(max(1, 34 - 4 * depth))
        lines.append(f"{'    ' * depth}{label} {status} {cls.type}" + (f" / {code}" if code else ""))
        for sub in sorted(cls.__subclasses__(), key=lambda c: c.__name__):
            if sub.__module__ == errors.__name__:
                visit(sub, depth + 1)

    visit(errors.OmnigateError, 0)
    return "```text\n" + "\n".join(lines) + "\n```\n"


def _render(what: str) -> str:
    from docs.hooks.config_reference import policy_reference, settings_reference

    if what == "config-reference: settings":
        return settings_reference()
    if what.startswith("config-reference: policy "):
        return policy_reference(what.rsplit(" ", 1)[1])
    return _error_tree()


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: _render(m.group(1)), markdown)


# The code's docstrings use Sphinx roles (":class:`X`"); the rendered page keeps the name and drops the role.
ROLE = re.compile(r":(?:class|mod|meth|func|attr|exc):\s?(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("", html)
