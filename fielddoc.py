"""Field documentation in ``help()``: a dataclass's fields carry their docs as string literals
under their declarations, which Python keeps nowhere; ``document_fields`` reads them from the
class's source and appends them to its docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import TypeVar

__all__ = ["document_fields"]

T = TypeVar("T")


def document_fields(cls: T) -> T:
    """Append ``name: type = default`` and the doc of each documented field to ``cls.__doc__``.
    Leaves the class as it is where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return cls
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    body = tree.body[0].body  # type: ignore[attr-defined]
    entries = []
    for node, after in zip(body, body[1:]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id in fields and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            continue
        f = fields[node.target.id]
        if f.default is not dataclasses.MISSING:
            default = f" = {f.default!r}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f" = {f.default_factory()!r}"
        else:
            default = ""
        entries.append(f"{f.name}: {ast.unparse(node.annotation)}{default}\n"
                       + textwrap.indent(inspect.cleandoc(after.value.value), "    "))
    if entries:
        cls.__doc__ = (inspect.cleandoc(cls.__doc__ or "") + "\n\nFields:\n\n" + "\n\n".join(entries))
    return cls
