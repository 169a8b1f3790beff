"""The router's policies and its per-replica cache view, without processes."""
from __future__ import annotations

import pytest

from pagedserve.router.backends import Backend
from pagedserve.router.routing_policies import CacheAwareConfig, Candidate, Picker


def picks(picker: Picker, candidates: list[Candidate], times: int, tokens: int = 0) -> list[int]:
    return [picker.pick(candidates, tokens).index for _ in range(times)]


def test_round_robin_splits_evenly_whatever_the_load():
    chosen = picks(Picker("round_robin"), [Candidate(0, 9), Candidate(1, 0), Candidate(2, 3)], 9)
    assert sorted(chosen) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_least_load_follows_load_and_shares_ties():
    picker = Picker("least_load")
    assert set(picks(picker, [Candidate(0, 5), Candidate(1, 2), Candidate(2, 7)], 5)) == {1}
    assert sorted(picks(picker, [Candidate(0, 1), Candidate(1, 1)], 4)) == [0, 0, 1, 1]


def test_cache_aware_weighs_the_hit_against_the_queue():
    picker = Picker("cache_aware", CacheAwareConfig(load_weight=100, balance_abs=4, balance_rel=1.5))
    # 512 cached tokens outweigh two more requests in flight (200 tokens' worth) ...
    assert picker.pick([Candidate(0, 3, 512), Candidate(1, 1, 0)], 600).index == 0
    # ... but 128 do not.
    assert picker.pick([Candidate(0, 3, 128), Candidate(1, 1, 0)], 600).index == 1
    # Nothing cached anywhere: least load, ties shared.
    assert sorted(picks(picker, [Candidate(0, 0), Candidate(1, 0)], 4, 600)) == [0, 0, 1, 1]


def test_cache_aware_goes_by_load_when_imbalanced():
    picker = Picker("cache_aware", CacheAwareConfig(load_weight=0, balance_abs=4, balance_rel=1.5))
    assert picker.pick([Candidate(0, 4, 1000), Candidate(1, 0, 0)], 1024).index == 0  # 4 over: not beyond
    assert picker.pick([Candidate(0, 6, 1000), Candidate(1, 1, 0)], 1024).index == 1
    assert picker.num_fallbacks == 1


@pytest.mark.parametrize("kwargs", [{"load_weight": -1}, {"balance_abs": -1}, {"balance_rel": 0.5}])
def test_cache_aware_config_refuses_nonsense(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CacheAwareConfig(**kwargs)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="policy must be one of"):
        Picker("random")


def test_backend_view_follows_snapshot_events_and_routing():
    b = Backend("http://x")
    h = [bytes([i]) * 32 for i in range(4)]
    b.apply({"type": "snapshot", "block_size": 16, "hashes": [h[0].hex(), h[1].hex()]})
    assert b.block_size == 16 and b.matched_blocks(h) == 2
    b.apply({"type": "events", "events": [["stored", h[2].hex()], ["removed", h[1].hex()]]})
    assert b.matched_blocks(h) == 1  # the chain breaks at the evicted block
    b.note_routed(h, ttl=30)  # routed there: counted as held until its events arrive
    assert b.matched_blocks(h) == 4
    b.apply({"type": "events", "events": [["stored", h[1].hex()], ["removed", h[3].hex()]]})
    assert b.matched_blocks(h) == 3 and not b.routed
    b.note_routed(h, ttl=-1)  # expired at once
    assert b.matched_blocks(h) == 3
    b.mark_down("test")
    assert not b.healthy and b.matched_blocks(h) == 0


def test_both_routers_answer_every_error_in_the_api_shape():
    """The server's error table (http/errors.py) is the routers' too: a route that raises
    is a 500 in the error shape (the replica router once answered plain text), an unknown
    path a 404 in it."""
    from starlette.testclient import TestClient

    from pagedserve.router.proxy import RouterConfig, build_router_app
    from pagedserve.router.disagg import DisaggConfig, build_disagg_app

    def boom(request):
        raise RuntimeError("a bug")

    for app in (build_router_app(RouterConfig(["http://127.0.0.1:9"], policy="round_robin"), None),
                build_disagg_app(DisaggConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]))):
        app.add_route("/boom", boom)
        client = TestClient(app, raise_server_exceptions=False)
        reply = client.get("/boom")
        assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
        assert "a bug" not in reply.text
        missing = client.get("/no/such/route")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_the_pd_router_refuses_a_body_over_its_limit_unread():
    """It parses the body before any instance sees it: without a limit one huge body was
    held (and parsed) whole in the router's memory."""
    from starlette.testclient import TestClient

    from pagedserve.router.disagg import DisaggConfig, build_disagg_app

    app = build_disagg_app(DisaggConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], max_request_body_size=1000))
    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * 2000 + b'"}')
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
        # Under the limit it goes on to the instances (none here: the router's own 503).
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
