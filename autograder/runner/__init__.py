"""The trusted side of one notebook: ``execute`` runs it cell by cell, ``trusted`` runs the
test and read-only cells in this process, ``channel`` talks to the kernel, ``publish`` gives a
build assignment's kernel what the read-only cells bound, ``sandbox`` builds the kernel's
sandbox, ``result`` is what a run reports. Rule: imports only ``protocol/`` and ``submitted/``.
"""
