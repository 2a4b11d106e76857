"""Issue 25, items 3 and 6: the trusted side's own bounds, and what people are shown.

Fast checks (no kernel): the budget on decoded elements and hashed keys per reply, the
worker's own memory and CPU limits, the feedback page of a job that failed, the explicit list
of classes that may cross the channel, control characters in student-controlled text, an
oversized notebook at collect, and an nbformat 3 notebook's message.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autograder.submission import Unreadable, load


# ------------------------------------------------------------------ (g) nbformat 3

def test_an_nbformat_3_notebook_gets_the_format_message_not_not_a_notebook(tmp_path: Path):
    old = {"nbformat": 3, "nbformat_minor": 0, "metadata": {},
           "worksheets": [{"cells": [{"cell_type": "code", "input": "x = 1"}]}]}
    path = tmp_path / "old.ipynb"
    path.write_text(json.dumps(old))
    with pytest.raises(Unreadable, match="notebook format 3; open and save it in JupyterLab"):
        load(path)
