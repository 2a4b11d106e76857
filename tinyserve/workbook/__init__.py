"""Course helpers the chapters and exercises call (not part of the engine).

- ``capacity``: KV bytes per sequence, GB vs GiB, device memory plans (chapter 2, Harbor).
- ``lab``: the predict-first widget (commit a guess, then see the answer).
- ``predict``: commit a guess, then measure; ``roofline_lab``: predict the batch size where a
  decode step stops being memory-bound; ``study_time``: estimated working time per notebook.
- ``plots``: the latency bars and phase-cost plots (chapters 0, 1, 9).
- ``model_card``: the shipped models' card (quality, size, training run).
- ``markers``: the README sections a command writes between two marker comments (the model
  card, the benchmark ledger).
"""
