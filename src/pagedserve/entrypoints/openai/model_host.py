"""The models of a multi-model server (docs/multi-model.md): each one's state, loaded on
first use, unloaded least-recently-used past --max-loaded-models, put to sleep and woken.

A loaded model is a whole single-model app (server.build_app over its own LLMEngine and
AsyncEngine), so every route, admission queue and metric works per model unchanged; the
front (multi_model_app.py) hands each request to the app of the model it names. One load
or unload runs at a time (a lock), so the bound on loaded models is checked against a
settled set; concurrent first requests for a model await the same load.

States: `unloaded` (never loaded, or unloaded: least recently used, keep_alive run
out), `loading`, `loaded`, `unloading`, `sleeping` (level 1: the engine and its KV pool
freed, the weights kept, so waking rebuilds only the engine; level 2: the weights
dropped too), `failed` (the load raised, or the engine crashed; its reason is kept and
the other models keep serving). A request for a sleeping or unloaded model loads it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from ...engine.llm_engine import LLMEngine
from ...http.errors import APIError
from ...model.loader import LoadedModel
from .args import ServerConfig
from .models_config import ModelSpec

logger = logging.getLogger("pagedserve.models")

BuildApp = Callable[[LLMEngine, ServerConfig], FastAPI]
# How soon a client turned away (a load still running, every loaded model busy) may retry.
_RETRY_AFTER_S = "2"


@dataclass(eq=False)
class HostedModel:
    spec: ModelSpec
    state: str = "unloaded"
    reason: str | None = None  # why the load failed
    sleep_level: int | None = None
    app: FastAPI | None = None
    weights: LoadedModel | None = None  # kept while asleep at level 1
    in_flight: int = 0  # requests the front is serving with it
    last_used: float = 0.0
    expires_at: float | None = None  # keep_alive: unloaded once idle past this (time.monotonic)
    loads: int = 0
    loading: asyncio.Future | None = None
    lifespan: AbstractAsyncContextManager | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def path(self) -> str:
        return self.spec.path

    @property
    def engine(self) -> LLMEngine | None:
        return None if self.app is None else self.app.state.engine.engine

    def card(self) -> dict[str, Any]:
        """The state /v1/models and /api/tags add to the model's entry."""
        return {"state": self.state, **({"aliases": list(self.spec.aliases)} if self.spec.aliases else {}),
                **({"reason": self.reason} if self.reason else {}),
                **({"sleep_level": self.sleep_level} if self.sleep_level else {})}


class ModelHost:
    def __init__(self, config: ServerConfig, specs: dict[str, ModelSpec], build_app: BuildApp):
        self.config = config
        self.models = {name: HostedModel(spec) for name, spec in specs.items()}
        self._aliases = {alias: name for name, spec in specs.items() for alias in spec.aliases}
        self._build_app = build_app
        self._lock = asyncio.Lock()

    def resolve(self, name: str | None) -> HostedModel:
        """The model a request names (or one of its aliases; the first model when it names
        none); 404 for another."""
        if name is None:
            return next(iter(self.models.values()))
        name = self._aliases.get(name, name)
        if name not in self.models:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {list(self.models)}",
                           param="model", code="model_not_found")
        return self.models[name]

    async def acquire(self, model: HostedModel) -> FastAPI:
        """The model's app, loading (or waking) it first; the caller `release`s it. 503 with
        Retry-After when the load outlasts --model-load-timeout or no loaded model is idle to
        make room; 503 with the reason when it failed to load."""
        if model.state != "loaded":
            await self._await_load(model)
        model.in_flight += 1
        model.last_used = time.monotonic()
        assert model.app is not None
        return model.app

    def release(self, model: HostedModel, keep_alive_s: float | None = None) -> None:
        """A request with `model` ended; `keep_alive_s` (Ollama's keep_alive, inf: for good)
        sets how long it stays loaded once idle."""
        model.in_flight -= 1
        model.last_used = time.monotonic()
        if keep_alive_s is not None:
            model.expires_at = None if math.isinf(keep_alive_s) else model.last_used + keep_alive_s

    async def _await_load(self, model: HostedModel) -> None:
        if model.loading is None:
            model.loading = asyncio.ensure_future(self._load(model))
        try:
            await asyncio.wait_for(asyncio.shield(model.loading), self.config.model_load_timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"the model {model.name!r} is still loading; retry shortly",
                           code="model_loading", headers={"Retry-After": _RETRY_AFTER_S}) from None
        if model.state == "failed":
            raise APIError(503, f"the model {model.name!r} failed to load: {model.reason}", code="model_failed")

    async def _load(self, model: HostedModel) -> None:
        """Build the model's app (after making room) and start its engine; a failure marks it failed."""
        try:
            async with self._lock:
                if model.state in ("loaded", "failed"):
                    return
                await self._make_room()
                model.state = "loading"
                logger.info("loading model %s from %s", model.name, model.path)
                # The model's own single-model configuration; its app answers to its aliases too.
                config = dataclasses.replace(self.config, served_model_name=[model.name, *model.spec.aliases],
                                             models={}, models_dir=None,
                                             models_config=None, max_loaded_models=None,
                                             engine=model.spec.engine_config(self.config.engine))
                try:
                    engine = await asyncio.to_thread(LLMEngine, config.engine, model.weights)
                    app = self._build_app(engine, config)
                    lifespan = app.router.lifespan_context(app)
                    await lifespan.__aenter__()
                except Exception as e:  # any load error: this model is out, the others serve on
                    logger.exception("model %s failed to load", model.name)
                    model.state, model.reason = "failed", f"{type(e).__name__}: {e}"
                    return
                app.state.engine.on_crash = lambda error: self._crashed(model, error)
                model.app, model.lifespan, model.weights = app, lifespan, None
                model.state, model.sleep_level, model.expires_at = "loaded", None, None
                model.loads += 1
        finally:
            model.loading = None

    def _crashed(self, model: HostedModel, error: BaseException) -> None:
        """The model's engine thread died (its requests already failed): it is failed now;
        the server and the other models go on."""
        reason = f"the engine crashed: {type(error).__name__}: {error}"
        logger.error("model %s: %s", model.name, reason)
        model.state, model.reason = "failed", reason  # at once: no new request reaches the dead engine
        asyncio.ensure_future(self._stop_crashed(model))

    async def _stop_crashed(self, model: HostedModel) -> None:
        async with self._lock:
            if model.lifespan is not None:
                await self._stop(model, None)
            model.state = "failed"

    async def _make_room(self) -> None:
        """Unload the least recently used idle model while the bound is reached; 503 when none is idle."""
        limit = self.config.max_loaded_models
        loaded = [m for m in self.models.values() if m.state == "loaded"]
        if limit is None or len(loaded) < limit:
            return
        idle = sorted((m for m in loaded if m.in_flight == 0), key=lambda m: m.last_used)
        if not idle:
            raise APIError(503, f"all {limit} loaded models are serving requests (--max-loaded-models); retry "
                                "shortly", code="models_busy", headers={"Retry-After": _RETRY_AFTER_S})
        await self._stop(idle[0], None)

    async def sleep(self, model: HostedModel, level: int) -> None:
        """Level 1: free the engine and its KV pool, keep the weights; level 2: drop both."""
        async with self._lock:
            if model.state != "loaded":
                return
            if model.in_flight:
                raise APIError(409, f"the model {model.name!r} is serving {model.in_flight} requests; "
                                    "retry once they end", code="model_busy", headers={"Retry-After": _RETRY_AFTER_S})
            await self._stop(model, level)

    async def wake_up(self, model: HostedModel) -> None:
        if model.state in ("sleeping", "unloaded"):
            await self._await_load(model)

    async def unload_expired(self) -> None:
        """Unload idle models whose keep_alive has run out."""
        now = time.monotonic()
        for model in self.models.values():
            if model.state == "loaded" and model.in_flight == 0 and model.expires_at is not None \
                    and model.expires_at <= now:
                async with self._lock:
                    if model.state == "loaded" and model.in_flight == 0:
                        await self._stop(model, None)

    async def close(self) -> None:
        async with self._lock:
            for model in self.models.values():
                if model.state == "loaded":
                    await self._stop(model, None)

    async def _stop(self, model: HostedModel, sleep_level: int | None) -> None:
        """Stop the model's engine (under the lock); asleep at level 1 it keeps its weights."""
        logger.info("unloading model %s%s", model.name, f" (sleep level {sleep_level})" if sleep_level else "")
        weights = model.engine.loaded if sleep_level == 1 and model.engine is not None else None
        assert model.lifespan is not None
        # Not "loaded" while its engine stops: a request arriving now waits for the lock, then loads it again.
        model.state = "unloading"
        lifespan, model.app, model.lifespan = model.lifespan, None, None
        await lifespan.__aexit__(None, None, None)
        model.weights, model.sleep_level, model.expires_at = weights, sleep_level, None
        model.state = "unloaded" if sleep_level is None else "sleeping"


async def run_reaper(host: ModelHost, period_s: float, stop: asyncio.Event) -> None:
    """Unload expired models every `period_s` until `stop` is set."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except asyncio.TimeoutError:
            await host.unload_expired()

