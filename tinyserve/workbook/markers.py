"""A README section a command writes: the text between two HTML-comment markers (the model
card, the benchmark ledger). Markdown renders nothing for the markers, and the text outside
them stays the author's."""
from __future__ import annotations

import re
from pathlib import Path


def _missing(path: Path, name: str) -> ValueError:
    return ValueError(f"{path} has no <!-- {name}:begin --> ... <!-- {name}:end --> section; "
                      f"add the two marker lines where the generated text belongs")


def section(path: Path, name: str) -> str:
    """The text currently between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    match = re.search(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), path.read_text(), re.S)
    if match is None:
        raise _missing(path, name)
    return match.group(1).strip()


def write_section(path: Path, name: str, markdown: str) -> None:
    """Replace the text between the ``name`` markers of ``path`` with ``markdown``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text()
    if begin not in text or end not in text:
        raise _missing(path, name)
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{markdown.strip()}\n{end}{tail}")
