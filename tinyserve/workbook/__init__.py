"""Course helpers the chapters and exercises call (not part of the engine).

- ``capacity``: KV bytes per sequence, GB vs GiB, device memory plans (chapter 2, Harbor).
- ``lab``: the predict-first widget (commit a guess, then see the answer).
- ``predict``: commit a guess, then measure (``parse_guess``: every box's one parser);
  ``roofline_lab``: predict the batch size where a decode step stops being memory-bound, and
  ``regime``, the course's one rule naming what bounds a measured step; ``scale_sweeps``: the
  sweeps chapters 2 and 3 run at both scales; ``study_time``: estimated working time per notebook.
- ``plots``: the latency bars and phase-cost plots (chapters 0, 1, 9).
- ``model_card``: the shipped models' card (quality, size, training run).
- ``markers``: the README sections a command writes between two marker comments (the model
  card, the benchmark ledger).
"""
