"""Parallelism across processes (chapter 7): tensor and pipeline parallel with torch.distributed.

- ``tensor``: column then row split of attention and MLP, one all-reduce after each
  (Megatron-style); shards, the in-process check and the worker each rank runs.
- ``pipeline``: layers split into stages, micro-batches, the bubble formula and its measurement.
- ``launch``: starts one process per rank (gloo on CPU, nccl on GPU) and reports the first failure.
- ``timing``: the workers that time both splits for the chapter and ``bench parallel``, and at
  scale (``bench scale``): two processes' read bandwidth against one, a TP decode step.

``from tinyserve.parallel import shard_model`` keeps working: ``tensor``'s names are re-exported.
"""
from .tensor import (CountingAllReduce, TPShard, check_split, column_shard, dist_all_reduce,
                     greedy_tokens, prepare_positions, row_shard, shard_model,
                     tp_check_worker, tp_forward_in_process)

__all__ = ["CountingAllReduce", "TPShard", "check_split", "column_shard", "dist_all_reduce",
           "greedy_tokens", "prepare_positions", "row_shard", "shard_model", "tp_check_worker",
           "tp_forward_in_process"]
