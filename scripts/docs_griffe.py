"""Griffe extension for the API pages of the docs site (mkdocs.yml). The docstrings are written for
``help()`` and doctest: Sphinx roles (``:meth:`x```) and bare ``>>>`` examples, which Markdown would
print literally or as nested quotes. Turn roles into code spans and each example into a code block."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:meth|func|class|attr|mod|exc|data|obj):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
    return f"`{name}`"


def markdown(docstring: str) -> str:
    """``docstring`` with roles as code spans and doctest examples fenced as ``pycon``."""
    out: list[str] = []
    lines = docstring.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(_ROLE.sub(_role, line))
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestsAndRoles(Extension):
    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
