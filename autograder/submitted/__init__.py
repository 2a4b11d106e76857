"""The learner's submitted text: read, repaired and scanned, never run here. ``submission``
rebuilds the graded notebook, ``scan`` and ``own_source`` read the code, ``shown`` escapes
what a learner controls wherever someone sees it.
"""
