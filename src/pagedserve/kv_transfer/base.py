"""The KV-connector interface, worker half (after vLLM V1's KVConnectorBase_V1).

The runner owns one of these next to its KV caches. Each step, before the forward, it
binds the metadata the scheduler half built (`bind_connector_metadata`) and starts the
step's loads (`start_load_kv`); after the step the engine collects what finished
(`get_finished`) and hands it to the scheduler half. A connector that moves KV inside
the forward would add per-layer waits and saves here; pagedserve's does not need them:
its loads run across steps beside the forward, and a producer serves blocks only after
the prefill that filled them has finished.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..core.kv_connector import KVConnectorMetadata, KVConnectorOutput


class KVConnectorWorker(ABC):
    engine_id: str
    # Where a consumer reaches this instance's blocks (producers).
    host: str
    port: int

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's per-layer caches, each laid out as core/kv_tensor_layout.py says."""

    @abstractmethod
    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        """The step's metadata from the scheduler half, before the forward."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start the loads the bound metadata asked for (they may finish in a later step)."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Sends and loads that finished (or failed) since the last call."""

    @abstractmethod
    def wait_for_activity(self, timeout: float) -> None:
        """Sleep until a transfer finishes or `timeout` seconds pass: the engine calls it
        instead of spinning when only transfers are in progress."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters for /metrics, by name."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop serving and loading."""

