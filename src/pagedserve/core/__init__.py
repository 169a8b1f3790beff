"""Scheduling and KV-block management in pure Python (standard library only).

The simulator reuses these classes with a cost model in place of the model
runner, so nothing here may import torch or numpy.
"""
from .block_pool import Block, BlockPool
from .scheduler_config import CacheConfig, SchedulerConfig
from .kv_cache import Allocation, KVCache, PrefixHit
from .kv_cache_manager import KVCacheManager
from .scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput, SchedulerStats
from .request import Request, RequestStatus
from .scheduler import Scheduler

__all__ = [
    "Allocation",
    "Block",
    "BlockPool",
    "CacheConfig",
    "KVCache",
    "KVCacheManager",
    "PrefixHit",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
