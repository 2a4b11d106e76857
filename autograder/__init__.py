"""Instructor tooling: release, collect, sandboxed autograde, feedback and export.

The package is laid out by who runs what, so the trust boundary can be seen in the tree.
Each room's ``__init__`` states its rule and ``tests/test_package_layout.py`` holds it:

- ``protocol/``: the wire format (``wire``) and the names both ends agree on (``contract``).
  Imports nothing from autograder.
- ``kernel/``: runs inside the learner's sandboxed kernel (``boot``, ``agent``). Imports only
  ``kernel/`` and ``protocol/``; nothing imports it (it is started by name).
- ``submitted/``: the learner's text, read and never run here (``submission``, ``scan``,
  ``own_source``, ``shown``).
- ``runner/``: the trusted side of one notebook (``execute``, ``trusted``, ``channel``,
  ``publish``, ``sandbox``, ``result``). Imports only ``protocol/`` and ``submitted/``.
- ``pipeline/``: the class's stages, one per file (``course``, ``collect``, ``exchange``,
  ``worker``, ``grade``, ``report``, ``check``, ``bench``).
- ``mutation/``: are the mistakes caught (``mutants``, ``semantic``, ``corpus``).

On top only doors, modules named from outside Python imports (a door may import every room;
no room imports a door): ``__main__`` and ``cli`` (the command line), ``testkit``,
``build_checks``, ``kernel_helpers`` and ``remote_policy`` (named by the notebooks' cells),
``validate`` (Jupyter's server extension) and ``nbfeedback`` (nbgrader's configuration).
"""
