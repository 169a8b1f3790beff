"""schemathesis against `pagedserve router` in both modes, each a process in front of
real servers on the embedded model (a cache_aware replica router before two servers; a
P/D router before a producer and a consumer), driven by the router's own /openapi.json:
no 5xx, every answer as the document says, and the router and every server healthy
after and exiting 0. `make fuzz` sends thousands of cases per operation to the same
deployments (api_fuzz.py --shapes router-replica,router-disagg).
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from schemathesis import GenerationMode

from server.api_fuzz import FUZZ_SERVER_FLAGS, fuzz_operation, load_schema, summary
from server.deployments import ROUTER_SHAPES, Deployment, start_deployment

# Per operation and generation mode.
EXAMPLES = int(os.environ.get("PAGEDSERVE_ROUTER_FUZZ_EXAMPLES", "15"))  # `make fuzz` runs thousands
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module", params=list(ROUTER_SHAPES))
def deployment(request, tmp_path_factory) -> Iterator[Deployment]:
    started = start_deployment(tmp_path_factory.mktemp(request.param), request.param, *FUZZ_SERVER_FLAGS)
    yield started
    log = started.log()
    exit_codes = started.stop()
    assert started.stopped_cleanly(exit_codes), (exit_codes, log)
    assert "Traceback" not in log, log


def test_schemathesis_finds_nothing_through_the_router(deployment):
    operations = [result.ok() for result in load_schema(deployment.url).get_all_operations()]
    assert operations
    for operation in operations:
        for mode in GenerationMode:
            run = fuzz_operation(operation, deployment.url, mode, EXAMPLES, seed=11)
            print(summary(run))
            assert not run.failures, "\n".join(run.failures)
            assert run.server_errors == run.unanswered == 0
    assert deployment.healthy(), deployment.log()
    # Still serving through the router, not just up.
    reply = httpx.post(deployment.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("bad_id", [2**64, -1])
def test_a_token_id_outside_the_vocabulary_gets_the_replicas_400(deployment, bad_id):
    # make fuzz found it: an id past int64 made the cache_aware router answer 500 (its
    # prompt keys could not be hashed).
    body = {"model": MODEL, "prompt": [1] * 48 + [bad_id], "max_tokens": 1}
    reply = httpx.post(deployment.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
    assert deployment.healthy()
