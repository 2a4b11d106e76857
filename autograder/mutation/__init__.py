"""Is every mistake caught? ``mutants`` (single-point changes of the solutions), ``semantic``
(a learner's mistakes, named) and their ``corpus``. Instructor-side only.
"""
