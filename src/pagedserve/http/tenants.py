"""Tenants at the door: who a key belongs to, whether the tenant's budgets admit one more
request, and what it used (the keys file is tenant_keys.py's).

Budgets are token buckets that hold a minute's worth and refill continuously:
- `rpm`: one unit per request, taken at admission;
- `tpm`: prompt tokens charged when a request reaches the engine, generated tokens as they
  stream. Those charges may take the bucket below zero; while it is not above zero every
  new request of the tenant gets 429, so a flood is cut off at the door and pays its debt
  before it gets in again. Requests already running finish (their overdraft is bounded by
  max_concurrency requests' prompt and max_tokens);
- `max_concurrency`: requests in flight, held until the response has ended.
A refusal is a 429 in the route's error shape with Retry-After: the seconds until the
bucket admits a request again (1 for the concurrency cap).

Which requests count: every POST but the ones that generate nothing (/tokenize,
/detokenize, /v1/messages/count_tokens), so a new generation route is metered without
being listed. All state lives on the event loop; SIGHUP reloads the file there.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError
from .middleware import OPEN_PATHS, normalize_path, presented_keys, unauthorized
from .tenant_keys import KeyTable, Tenant, load_key_table

logger = logging.getLogger("pagedserve.tenants")

UNMETERED_PATHS = frozenset({"/tokenize", "/detokenize", "/v1/messages/count_tokens"})
BUDGETS = ("rpm", "tpm", "concurrency")
_SECONDS_PER_MINUTE = 60.0


@dataclass(slots=True)
class TokenBucket:
    """`per_minute` units a minute, at most a minute's worth saved; charges may overdraw it."""

    per_minute: int
    level: float
    updated: float

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.level = min(float(self.per_minute), self.level + elapsed * self.per_minute / _SECONDS_PER_MINUTE)
        self.updated = now

    def seconds_until(self, amount: float, now: float) -> float:
        """How long until the bucket holds `amount` (0: it does now)."""
        self.refill(now)
        return max(0.0, (amount - self.level) * _SECONDS_PER_MINUTE / self.per_minute)

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount


def _bucket(per_minute: int | None, old: TokenBucket | None, now: float) -> TokenBucket | None:
    """A bucket for a (re)loaded budget: a new one starts full, a changed one keeps its level."""
    if per_minute is None:
        return None
    if old is None:
        return TokenBucket(per_minute, float(per_minute), now)
    old.refill(now)
    return TokenBucket(per_minute, min(old.level, float(per_minute)), now)


@dataclass(frozen=True, slots=True)
class Refusal:
    budget: str  # one of BUDGETS
    retry_after_s: int
    message: str


@dataclass(slots=True)
class TenantState:
    """One tenant's budgets and what it used since the server started."""

    tenant: Tenant
    rpm: TokenBucket | None
    tpm: TokenBucket | None
    clock: Callable[[], float] = field(repr=False, default=time.monotonic)
    in_flight: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUDGETS, 0))

    @classmethod
    def new(cls, tenant: Tenant, clock: Callable[[], float]) -> TenantState:
        now = clock()
        return cls(tenant, _bucket(tenant.rpm, None, now), _bucket(tenant.tpm, None, now), clock)

    def reconfigure(self, tenant: Tenant, now: float) -> None:
        self.tenant = tenant
        self.rpm, self.tpm = _bucket(tenant.rpm, self.rpm, now), _bucket(tenant.tpm, self.tpm, now)

    def admit(self) -> Refusal | None:
        """Take a seat and a request unit, or say which budget refuses and for how long."""
        t, now = self.tenant, self.clock()
        refusal = None
        if t.max_concurrency is not None and self.in_flight >= t.max_concurrency:
            refusal = Refusal("concurrency", 1, f"{t.max_concurrency} requests in flight")
        elif self.rpm is not None and (wait := self.rpm.seconds_until(1, now)) > 0:
            refusal = Refusal("rpm", _whole_seconds(wait), f"{t.rpm} requests a minute")
        elif self.tpm is not None and (wait := self.tpm.seconds_until(1, now)) > 0:
            refusal = Refusal("tpm", _whole_seconds(wait), f"{t.tpm} tokens a minute")
        if refusal is not None:
            self.refused[refusal.budget] += 1
            return refusal
        if self.rpm is not None:
            self.rpm.take(1, now)
        self.in_flight += 1
        self.requests += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1

    def charge_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens += num_tokens
        self._charge(num_tokens)

    def charge_generated(self, num_tokens: int) -> None:
        self.generation_tokens += num_tokens
        self._charge(num_tokens)

    def _charge(self, num_tokens: int) -> None:
        if self.tpm is not None and num_tokens:
            self.tpm.take(num_tokens, self.clock())


def _whole_seconds(wait: float) -> int:
    return max(1, math.ceil(wait))


# The tenant of the HTTP request being served, set by TenantMiddleware for the rest of the
# request (the route, its response stream): the serving code reads it where it builds engine
# requests and counts tokens, so no endpoint's signature carries it.
_CURRENT: contextvars.ContextVar[TenantState | None] = contextvars.ContextVar("pagedserve_tenant", default=None)


def current_tenant() -> TenantState | None:
    return _CURRENT.get()


@contextlib.contextmanager
def acting_for(state: TenantState | None) -> Iterator[None]:
    """Serve work inside as `state`'s (a batch line runs for the tenant that created the batch)."""
    token = _CURRENT.set(state)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class Tenants:
    """The key table in force and every tenant's state (kept across reloads, by name)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.clock = clock
        self.states: dict[str, TenantState] = {}
        self.table = self._apply(load_key_table(path))

    def authenticate(self, scope: Scope) -> TenantState | None:
        table = self.table
        tenants = [table.lookup(key) for key in presented_keys(scope)]
        found = next((t for t in tenants if t is not None), None)
        return None if found is None else self.states[found.name]

    def reload(self) -> bool:
        """Read the file again; keep the keys in force if it is bad (logged)."""
        try:
            table = load_key_table(self.path)
        except ValueError as e:
            logger.error("not reloading the keys: %s; keeping the %d keys loaded before", e, len(self.table.digests))
            return False
        self.table = self._apply(table)
        logger.info("reloaded %s: %d keys of %d tenants", self.path, len(table.digests), len(table.tenants))
        return True

    def watch_sighup(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        """Reload on SIGHUP, on the loop; returns what stops it."""
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        return lambda: loop.remove_signal_handler(signal.SIGHUP)

    def _apply(self, table: KeyTable) -> KeyTable:
        now = self.clock()
        for name, tenant in table.tenants.items():
            if name in self.states:
                self.states[name].reconfigure(tenant, now)
            else:
                self.states[name] = TenantState.new(tenant, self.clock)
        return table


class TenantMiddleware:
    """The API-key check with many keys: a key names its tenant, whose budgets admit the
    request or answer 429 (Retry-After, the route's error shape)."""

    def __init__(self, app: ASGIApp, tenants: Tenants):
        self.app = app
        self._tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = normalize_path(scope["path"]) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = self._tenants.authenticate(scope)
        if state is None:
            await unauthorized().response(scope["path"])(scope, receive, send)
            return
        metered = scope["method"] == "POST" and path not in UNMETERED_PATHS
        refusal = state.admit() if metered else None
        if refusal is not None:
            error = APIError(429, f"tenant {state.tenant.name!r} is over its budget of {refusal.message}; retry in "
                                  f"{refusal.retry_after_s} s", code="rate_limit_exceeded",
                             headers={"Retry-After": str(refusal.retry_after_s)})
            await error.response(scope["path"])(scope, receive, send)
            return
        token = _CURRENT.set(state)
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)
            if metered:
                state.release()
