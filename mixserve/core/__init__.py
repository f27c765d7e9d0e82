"""The pure-Python core: scheduler, prefill policies, plan/split, KV block pool. Standard library only."""

from mixserve.core.batch import Chunk, ForwardBatch, ForwardSeq, RequestId, ScheduleOutput, StepPlan
from mixserve.core.blocks import BlockPool, BlockSpace
from mixserve.core.config import SchedulerConfig
from mixserve.core.plan import plan, split
from mixserve.core.policy import Chunked, PrefillPolicy, WholePrompt
from mixserve.core.prefix_cache import PrefixCachingPool
from mixserve.core.scheduler import Scheduler
from mixserve.core.stats import SchedulerStats

__all__ = [
    "BlockPool",
    "BlockSpace",
    "Chunk",
    "Chunked",
    "ForwardBatch",
    "ForwardSeq",
    "PrefillPolicy",
    "PrefixCachingPool",
    "RequestId",
    "ScheduleOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepPlan",
    "WholePrompt",
    "plan",
    "split",
]
