"""Tensor parallel on torch.distributed: the split plan (shard), the collectives (group), the ranks (worker).

Rank 0 is the engine's own process (scheduler, server); ranks 1..N-1 are spawned processes that only run
the model, receiving each step's ForwardBatch by broadcast. docs/tensor-parallel.md gives the decisions.
"""
