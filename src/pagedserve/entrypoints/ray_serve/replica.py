"""One engine replica: pagedserve's own server app (entrypoints/openai/server.py) around an
LLMEngine, called in-process for each request the ingress hands over (asgi_call.py).

Serve asks it for `record_routing_stats` every `router.stats_period_s`: the block hashes its
prefix cache holds (what the request router matches prompts against, as `pagedserve
router` learns them from /v1/kv_events), its prefix-cache counters and, under P/D, its KV
connector's; and for
`check_health`, which fails once the engine thread has crashed, so Serve replaces it."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import AsyncIterator

import ray
from ray import serve

from ...engine.llm_engine import LLMEngine
from ..openai.args import ServerConfig
from ..openai.server import build_app
from .asgi_call import ProxiedRequest, ReplyStart, call_asgi

logger = logging.getLogger("pagedserve.ray_serve")
REPLICA_HEADER = "x-pagedserve-replica"


class EngineReplica:
    async def __init__(self, server: ServerConfig):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        kv_transfer = server.engine.kv_transfer_config
        if kv_transfer is not None:  # P/D: a producer's block server must be reachable from other nodes
            kv_transfer = dataclasses.replace(kv_transfer, kv_host=ray.util.get_node_ip_address())
            server = dataclasses.replace(server, engine=dataclasses.replace(server.engine,
                                                                            kv_transfer_config=kv_transfer))
        self.engine = LLMEngine(server.engine)
        # Only the ingress is reachable from outside: it checks the API key and the body limit.
        self.app = build_app(self.engine, server)
        self.async_engine = self.app.state.engine
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self._stats_seq = itertools.count()
        logger.info("replica %s serving %s", self.replica_id, self.engine.loaded.name)

    async def handle(self, request: ProxiedRequest) -> AsyncIterator[ReplyStart | bytes]:
        async for item in call_asgi(self.app, request):
            if isinstance(item, ReplyStart):
                item = ReplyStart(item.status, [*item.headers, (REPLICA_HEADER, self.replica_id)])
            yield item

    async def record_routing_stats(self) -> dict:
        block_size, hashes = await self.async_engine.run_on_thread(
            lambda e: (e.config.kv.block_size, e.scheduler.kv_cache.cached_hashes()))
        snap = self.async_engine.snapshot
        return {"replica": self.replica_id, "pid": os.getpid(), "seq": next(self._stats_seq), "block_size": block_size,
                "hashes": [h.hex() for h in hashes], "prefix_cache_hits": snap.prefix_cache_hits,
                "prefix_cache_queries": snap.prefix_cache_queries,
                "kv_transfer": dict(self.engine.kv_connector.counters) if self.engine.kv_connector is not None else {}}

    def check_health(self) -> None:
        if not self.async_engine.is_healthy:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not stepping")

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)
