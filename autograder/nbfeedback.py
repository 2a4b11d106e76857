"""A preprocessor for nbgrader's own feedback (formgrader's "Generate feedback" button).

Our ``python -m autograder feedback`` never shows test source. nbgrader's feedback renders
the autograded notebook itself, which holds the hidden tests and full tracebacks (a traceback
quotes the failing test line). nbgrader_config.py adds this preprocessor so that path is safe
too: hidden-test regions are cut and every error keeps only its ``ename: evalue`` line.
"""
from __future__ import annotations

from nbconvert.preprocessors import Preprocessor
from nbgrader.preprocessors import ClearHiddenTests


class SanitizeFeedback(ClearHiddenTests):
    def preprocess_cell(self, cell, resources, cell_index):
        cell, resources = super().preprocess_cell(cell, resources, cell_index)
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                out["traceback"] = [f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"]
        return cell, resources


class SanitizeStudentHTML(Preprocessor):
    """Strip active content from what the instructor's views render (formgrader, feedback).

    A student's written answer (markdown) and a code cell's HTML, SVG, markdown or
    JavaScript output are the student's text; rendered raw in the instructor's Jupyter
    session, a ``<script>`` in them would run with the instructor's rights. nbconvert's
    ``sanitize_html`` (set in nbgrader_config.py) cleans outputs, but nbgrader's formgrade
    template renders markdown cells itself, unsanitized; so this preprocessor cleans the
    notebook first, with nbconvert's own ``clean_html``, before any template sees it.
    """

    def preprocess_cell(self, cell, resources, cell_index):
        from nbconvert.filters.strings import clean_html
        if cell.cell_type in ("markdown", "raw"):
            cell.source = clean_html(cell.source)
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            for mime in list(data):
                if mime in ("application/javascript", "text/javascript") \
                        or "widget-view" in mime:
                    del data[mime]
                elif mime in ("text/html", "image/svg+xml", "text/markdown"):
                    data[mime] = clean_html(data[mime])
        return cell, resources
