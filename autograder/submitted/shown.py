"""Anything a learner controls, made safe to show: printed, exported or put on a page."""
from __future__ import annotations

import re

# Characters a terminal, a spreadsheet or a page would act on instead of showing: C0 and C1
# controls (an ANSI/OSC escape starts with ESC or CSI and can recolour, retitle, hide or
# hyperlink what follows) and the bidirectional overrides (they reorder what a reader sees),
# plus lone surrogates, which cannot be written as UTF-8 at all.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_LINE_BREAKS = "\n\t"


def shown(text: object, *, lines: bool = False) -> str:
    """``text`` safe to print, export or put on a page: every character of ``_UNSHOWN`` is
    written as a visible escape (``\\x1b``), a lone surrogate as U+FFFD, a newline or tab as
    a space (one line of a summary or a CSV cell); with ``lines``, newlines and tabs stay (a
    whole page). Use it on anything a student controls (grade ids, file names, error
    messages) wherever it leaves the grader: printed, exported or written on a page."""
    def escape(m: re.Match) -> str:
        c = m.group()
        if c in _LINE_BREAKS:
            return c if lines else " "
        if "\ud800" <= c <= "\udfff":
            return "\ufffd"
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return _UNSHOWN.sub(escape, str(text))
