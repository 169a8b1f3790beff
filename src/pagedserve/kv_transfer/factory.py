"""The worker half named by a KVTransferConfig (which has checked the name)."""
from __future__ import annotations

from ..core.kv_connector import KVTransferConfig
from .base import KVConnectorWorker
from .pagedserve_connector import PagedServeConnectorWorker

_WORKERS: dict[str, type[KVConnectorWorker]] = {"PagedServeConnector": PagedServeConnectorWorker}


def make_kv_connector_worker(config: KVTransferConfig) -> KVConnectorWorker:
    return _WORKERS[config.kv_connector](config)
