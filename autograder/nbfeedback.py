"""A preprocessor for nbgrader's own feedback (formgrader's "Generate feedback" button).

Our ``python -m autograder feedback`` never shows test source. nbgrader's feedback renders
the autograded notebook itself, which holds the hidden tests and full tracebacks (a traceback
quotes the failing test line). nbgrader_config.py adds this preprocessor so that path is safe
too: hidden-test regions are cut and every error keeps only its ``ename: evalue`` line.
"""
from __future__ import annotations

from nbgrader.preprocessors import ClearHiddenTests


class SanitizeFeedback(ClearHiddenTests):
    def preprocess_cell(self, cell, resources, cell_index):
        cell, resources = super().preprocess_cell(cell, resources, cell_index)
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                out["traceback"] = [f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"]
        return cell, resources
