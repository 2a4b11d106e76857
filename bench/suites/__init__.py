"""The benchmark suites, one per file, found by name: ``python -m tinyserve bench NAME`` runs
``NAME.py``'s ``run(json_path, quick)`` (:func:`bench.run_suite`); the CLI lists every file
here whose name does not start with ``_``, described by its docstring's first paragraph.

A suite may set, as literals at its top: ``COMPILABLE = True`` (it takes ``--compile``),
``OWN_THREADS = N`` (cores a run keeps busy, for the load stamp), ``BENCH_ALL = False`` (left
out of ``bench all``). What several suites share and the harness does not need sits here in a
``_`` file: ``_engine_runs`` (the serving-engine suites' model, engine run and latency
figures) and ``_plain_loop`` (bench hf's yardstick). What the harness needs too (the report,
its table, the timers) is :mod:`bench.common`.
"""
