"""Refresh the README's screenshots in docs/screenshots/ (a tool, not a test).

    make e2e                                   # writes artifacts/e2e/ (widget, feedback)
    .venv/bin/python tests/e2e/screenshots.py  # adds a chapter, copies the three PNGs

The chapter shot needs outputs, so chapter 2 is executed first (about a minute) into a
throwaway course copy, then opened in JupyterLab and scrolled to its first plot.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.conftest import ARTIFACTS, CHROMIUM_ARGS, chromium_path  # noqa: E402
from e2e.jlab import ROOT, LabServer, copy_course, current_notebook, reveal  # noqa: E402

OUT = ROOT / "docs" / "screenshots"
CHAPTER = "course/02_kv_cache.ipynb"
FROM_ARTIFACTS = {
    "lab-widget.png": "test_learner_runs_the_first_exercise_and_validates/03-widget-answer.png",
    "feedback-report.png":
        "test_instructor_sees_assignments_a_graded_submission_and_feedback/03-feedback.png",
    "hub-assignments.png":
        "test_student_fetches_submits_and_reads_feedback_through_the_hub/04-submitted.png",
    "hub-feedback.png":
        "test_student_fetches_submits_and_reads_feedback_through_the_hub/05-feedback.png",
}


def chapter_shot(dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="shots-") as tmp:
        course = copy_course(Path(tmp) / "course", "START_HERE.ipynb", "course")
        path = course / CHAPTER
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)
        server = LabServer(course, state_dir=Path(tmp) / "state", log_path=Path(tmp) / "lab.log")
        server.start()
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium_path(), headless=True,
                                             args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(60_000)
                page.goto(f"{server.url}/lab/tree/{CHAPTER}")
                plot = reveal(current_notebook(page).locator(".jp-RenderedImage img").first)
                plot.evaluate("img => img.scrollIntoView({block: 'center'})")
                page.screenshot(path=str(dest))
                browser.close()
        finally:
            server.stop()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    chapter_shot(OUT / "chapter.png")
    for name, rel in FROM_ARTIFACTS.items():
        src = ARTIFACTS / rel
        if not src.exists():
            sys.exit(f"{src} is missing: run `make e2e` first")
        shutil.copy(src, OUT / name)
    for png in sorted(OUT.glob("*.png")):
        print(f"{png.relative_to(ROOT)}  {png.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
