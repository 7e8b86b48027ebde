"""User text in generated files (module paths, ModuleDict keys, source lines) as inert text.

Names reach gencode{rank}.py from the user's model: a key read from a config or a data set may hold
quotes, newlines or backslashes. Strings are written with repr() (a Python literal whatever they
hold); comments and docstrings get every non-printable character escaped, so nothing can end the
comment line or the docstring.
"""

from __future__ import annotations

__all__ = ["literal", "comment_text", "docstring_text"]


def literal(text: str) -> str:
    """A Python string literal of `text` (double-quoted, the generated files' style, when possible)."""
    code = repr(str(text))
    if code.startswith("'") and '"' not in text and "'" not in text:
        return f'"{code[1:-1]}"'  # repr escaped everything else; only the quote character changes
    return code


def comment_text(text: str) -> str:
    """`text` on one line: newlines, carriage returns and other control characters escaped."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))


def docstring_text(text: str) -> str:
    """`text` safe inside a triple-double-quoted docstring: one line, backslashes and quotes escaped."""
    return comment_text(str(text).replace("\\", "\\\\")).replace('"', '\\"')
