"""nbgrader configuration: the repository root is the course directory.

Used by the nbgrader command line, the formgrader and the Validate button in JupyterLab.
`python -m autograder` passes the same layout explicitly (see autograder/course.py), so both
agree. Autograding untrusted submissions goes through `python -m autograder autograde`, which
runs each one in the bubblewrap sandbox; plain `nbgrader autograde` would not.
"""
import os

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

_ROOT = os.path.dirname(os.path.abspath(__file__))

c.CourseDirectory.root = _ROOT
c.CourseDirectory.course_id = "tinyserve"
c.CourseDirectory.source_directory = "solutions"      # notebooks with solutions + hidden tests
c.CourseDirectory.release_directory = "exercises"     # what learners get (committed)
c.CourseDirectory.submitted_directory = "grading/submitted"
c.CourseDirectory.autograded_directory = "grading/autograded"
c.CourseDirectory.feedback_directory = "grading/feedback"
c.CourseDirectory.db_url = f"sqlite:///{os.path.join(_ROOT, 'grading', 'gradebook.db')}"

# The per-cell timeout that takes effect in nbgrader 0.9 (Validate and nbgrader autograde).
c.Execute.timeout = 120
c.Execute.interrupt_on_timeout = True
# A deleted test cell must come back, not vanish with its points.
c.OverwriteCells.add_missing_cells = True
# Rubrics of written answers sit in ### BEGIN/END MARK SCHEME regions of the locked
# question cells; release cuts them, the grader's copy (and so feedback) keeps them.
c.ClearMarkScheme.enforce_metadata = False
# Validate: show every failing test, not only the first.
c.Validator.validate_all = True

# nbgrader's own feedback (formgrader's button) renders the autograded notebook: cut the
# hidden tests and tracebacks from it. `python -m autograder feedback` is the main path.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "autograder.nbfeedback.SanitizeFeedback",
    "autograder.nbfeedback.SanitizeStudentHTML",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]

# Everything the instructor's views render from a submission is the student's text: strip
# active content (a <script> in a written answer or an output would run in the instructor's
# session). The formgrader's submission view and nbgrader's feedback both use HTMLExporter.
c.HTMLExporter.sanitize_html = True
c.HTMLExporter.preprocessors = ["autograder.nbfeedback.SanitizeStudentHTML"]
