"""Tensor parallelism over torch.distributed: sharded weights and KV heads per rank, the
step message rank 0 broadcasts, the worker loop and the rank-0 executor
(docs/tensor-parallel.md)."""
