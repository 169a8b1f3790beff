"""Real `pagedserve serve` processes on loopback ports.

One shared server per session with a small KV cache; tests that need other flags
(an API key, a tiny queue, SIGTERM) start their own through `start_server`.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .server_process import ServerProcess, start_server


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def server(server_logs) -> Iterator[ServerProcess]:
    proc = start_server(server_logs)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def fp32_server(server_logs) -> Iterator[ServerProcess]:
    """The oracle path: the GGUF's blocks multiplied in fp32 with an fp32 cache, which
    equals transformers' float32 model (the default server runs int8 activations)."""
    proc = start_server(server_logs, "--quantization", "none")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def spec_server(server_logs) -> Iterator[ServerProcess]:
    """A server with n-gram speculative decoding, whose /metrics carries the spec_decode_* series."""
    proc = start_server(server_logs, "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id
