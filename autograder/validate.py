"""nbgrader's Validate button, run on the grading path: test cells in the trusted runner.

Stock nbgrader validates by executing every cell, test cells included, in the learner's
kernel (``nbgrader.validator.Validator`` with its ``Execute`` preprocessor). The course's
grading never runs test code there (``autograder.runner.channel``), and Validate must give the same
verdicts as grading, so this Jupyter server extension keeps nbgrader's button, handler and
report (which cells changed, failed or passed, and how the dialog shows them) and swaps only
how the notebook is run: ``TrustedValidator._preprocess`` runs it with
``autograder.runner.execute.run_notebook`` and the grading plan, exactly as ``python -m autograder
check`` does, setup cells skipped (:mod:`autograder.submitted.setup_cells`: an install
cell is never run; the skipped cell shows why, and the server's log says so) and the kernel's
debugger warning silenced (:func:`autograder.pipeline.check.kernel_env`). Enabled per role in
``.jupyter/roles/*/jupyter_server_config.json``.
"""
from __future__ import annotations

import os
import subprocess

import nbformat
from nbgrader import utils
from nbgrader.preprocessors import CheckCellMetadata, ClearOutput
from nbgrader.validator import Validator


class TrustedValidator(Validator):
    """nbgrader's Validator whose execution step is the trusted runner's."""

    def _preprocess(self, nb):  # type: ignore[override]
        from jupyter_client import AsyncKernelManager

        from autograder.pipeline.check import kernel_env
        from autograder.pipeline.worker import grading_plan
        from autograder.runner.execute import run_notebook
        from autograder.submitted.setup_cells import setup_cells, skip_setup_cells
        resources: dict = {}
        with utils.setenv(NBGRADER_VALIDATING="1", NBGRADER_EXECUTION="validate"):
            for preprocessor in (CheckCellMetadata, ClearOutput):
                nb, resources = preprocessor(parent=self).preprocess(nb, resources)
            kernel = (nb.metadata.get("kernelspec") or {}).get("name") or "python3"
            skipped = [c.index for c in setup_cells(nb)]
            notes = skip_setup_cells(nb)
            for note in notes:
                self.log.warning("Validate: %s", note)
            # nbgrader calls this inside the notebook's folder: relative data paths work.
            run_notebook(nb, AsyncKernelManager(kernel_name=kernel), cwd=os.getcwd(),
                         env=kernel_env(), plan=grading_plan(nb), cell_timeout=120,
                         total_timeout=1200, kernel_output=subprocess.DEVNULL)
            for index, note in zip(skipped, notes):
                nb.cells[index].outputs = [nbformat.v4.new_output(
                    "stream", name="stdout", text=note + "\n")]
        return nb


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "autograder.validate"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Point nbgrader's validate handler at TrustedValidator (it looks the class up by name
    on every request, so the order in which the extensions load does not matter)."""
    from nbgrader.server_extensions.validate_assignment import handlers
    handlers.Validator = TrustedValidator
    serverapp.log.info("autograder: Validate runs test cells in the trusted runner")
