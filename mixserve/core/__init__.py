"""The pure-Python core: scheduler, prefill policies, plan/split, KV block pool. Standard library only."""

from mixserve.core.batch import Chunk, ForwardBatch, ForwardSeq, RequestId, ScheduleOutput, StepPlan

__all__ = ["Chunk", "ForwardBatch", "ForwardSeq", "RequestId", "ScheduleOutput", "StepPlan"]
