"""Compiled grammars, each compiled once per (kind, text), under a time limit.

Compiling runs on a worker thread and the caller waits at most `compile_timeout`
seconds, so a pathological schema or regex becomes a ValueError (a 400 on the
server) instead of a hung engine or event loop. The backend is created on the
first constrained request: engines that never see one never pay for (or need) it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..model.tokenizer import Tokenizer
from .grammar_backend import Grammar, Matcher, StructuredOutputBackend
from .backend_registry import make_backend
from .spec import StructuredOutputs

DEFAULT_COMPILE_TIMEOUT = 10.0
DEFAULT_CACHE_SIZE = 256


class StructuredOutputManager:
    """Thread-safe: the server compiles from its request threads, the engine from its own."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = "llguidance",
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT, cache_size: int = DEFAULT_CACHE_SIZE):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._backend_name = backend
        self._backend: StructuredOutputBackend | None = None
        self.compile_timeout = compile_timeout
        self._cache_size = cache_size
        # Finished and in-flight compiles: a second request for a spec being compiled waits on the same one.
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()  # guards the cache
        self._backend_lock = threading.Lock()  # the backend is built once, without holding up cache hits
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """The compiled grammar for `spec`; ValueError if it is invalid or takes too long."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, *key)
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.compile_timeout)
        except FutureTimeout:
            # The compile keeps its worker until the backend's own limits end it;
            # dropping it from the cache lets a retry start afresh.
            self._forget(key, future)
            raise ValueError(
                f"structured_outputs: compiling the {key[0]} took longer than {self.compile_timeout:g} s"
            ) from None
        except ValueError:
            self._forget(key, future)
            raise

    def matchers(self, spec: StructuredOutputs, n: int) -> list[Matcher]:
        """One matcher per sample of a request with `n` samples, all at the grammar's start."""
        grammar = self.compile(spec)
        return [grammar.matcher() for _ in range(n)]

    def _compile(self, kind: str, text: str) -> Grammar:
        with self._backend_lock:
            if self._backend is None:
                self._backend = make_backend(self._backend_name, self._tokenizer, self._vocab_size)
            backend = self._backend
        return backend.compile(kind, text)

    def _forget(self, key: tuple[str, str], future: Future[Grammar]) -> None:
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]
