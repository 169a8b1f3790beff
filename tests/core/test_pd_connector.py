"""The scheduler half of disaggregated prefill/decode, on the fake runner.

A producer and a consumer scheduler, each with its FakeRunner; a stand-in worker half
copies the fake KV of the blocks the metadata names from the producer's runner into the
consumer's. The fake runner checks every position a new row reads, so a load into the
wrong blocks, a missing block or a stale prefix changes the output and fails the test.
"""
from __future__ import annotations

import pytest

from fake_runner import FakeRunner, make_scheduler, reference_output
from pagedserve.core import Request, RequestStatus
from pagedserve.core.kv_connector import KVConnectorOutput, KVTransferConfig
from pagedserve.core.pd_connector import PagedServeConnectorScheduler, token_digest
from pagedserve.core.scheduler import Scheduler

BS = 4


def pd_scheduler(role: str, policy: str = "recompute", num_blocks: int = 64) -> Scheduler:
    config = KVTransferConfig(kv_role=role, kv_load_failure_policy=policy)
    connector = PagedServeConnectorScheduler(config, BS, f"engine-{role}", "127.0.0.1", 1)
    return make_scheduler(num_blocks=num_blocks, block_size=BS, kv_connector=connector)


class Pair:
    """Producer and consumer with their runners and a worker half that moves fake KV."""

    def __init__(self, fail_loads: bool = False, policy: str = "recompute"):
        self.prod, self.cons = pd_scheduler("kv_producer"), pd_scheduler("kv_consumer", policy)
        self.prod_runner = FakeRunner(64, BS)
        self.cons_runner = FakeRunner(64, BS)
        self.fail_loads = fail_loads
        self.held: dict[str, tuple[int, ...]] = {}
        self.loads = []  # LoadSpecs seen
        self.releases = []
        self._pending = (KVConnectorOutput(), KVConnectorOutput())
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, RequestStatus] = {}

    def _step(self, sched: Scheduler, runner: FakeRunner, side: int) -> None:
        out = sched.schedule()
        meta = out.kv_connector_metadata
        if meta is not None:
            self._bind(meta)
        sampled = runner.execute(out)
        for u in sched.update(out, sampled) + sched.update_connector_output(self._take(side)):
            self.outputs.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished is not None:
                self.finished[u.request_id] = u.finished
        sched.check_invariants()

    def _bind(self, meta) -> None:
        prod_out, cons_out = self._pending
        for send in meta.sends:
            self.held[send.request_id] = send.block_ids
        for spec in meta.loads:
            self.loads.append(spec)
            ok = not self.fail_loads and set(spec.remote_block_ids) <= set(self.held.get(spec.remote.request_id, ()))
            if ok:
                src, dst = self.prod_runner, self.cons_runner
                for r, l in zip(spec.remote_block_ids, spec.local_block_ids):
                    dst.tokens[l * BS:(l + 1) * BS] = src.tokens[r * BS:(r + 1) * BS]
                    dst.states[l * BS:(l + 1) * BS] = src.states[r * BS:(r + 1) * BS]
                del self.held[spec.remote.request_id]
                prod_out.finished_sending.add(spec.remote.request_id)
            (cons_out.finished_recving if ok else cons_out.failed_recving).add(spec.request_id)
        for remote in meta.releases:
            self.releases.append(remote)
            if self.held.pop(remote.request_id, None) is not None:
                prod_out.finished_sending.add(remote.request_id)

    def _take(self, side: int) -> KVConnectorOutput:
        out = self._pending[side]
        self._pending = tuple(KVConnectorOutput() if i == side else o for i, o in enumerate(self._pending))
        return out

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not (self.prod.has_unfinished_requests() or self.prod.has_connector_work()
                    or self.cons.has_unfinished_requests() or self.cons.has_connector_work()):
                return
            self._step(self.prod, self.prod_runner, 0)
            self._step(self.cons, self.cons_runner, 1)
        raise AssertionError("not done")

    def prefill(self, rid: str, prompt: list[int]) -> dict:
        req = Request(rid, prompt, 1, ignore_eos=True, kv_transfer_params={"do_remote_decode": True})
        self.prod.add_request(req)
        while not req.is_finished:
            self._step(self.prod, self.prod_runner, 0)
        return req.kv_transfer_result

    def assert_all_free(self) -> None:
        for sched in (self.prod, self.cons):
            assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
            assert not sched.has_unfinished_requests() and not sched.has_connector_work()


def decode_request(rid: str, prompt: list[int], params: dict | None, max_tokens: int = 6) -> Request:
    return Request(rid, prompt, max_tokens, ignore_eos=True, kv_transfer_params=params)


PROMPT = list(range(100, 118))  # 18 tokens: 17 to load, 5 blocks of 4


def test_decode_loads_the_prefill_and_matches_the_reference():
    pair = Pair()
    params = pair.prefill("p", PROMPT)
    assert params["remote_block_ids"] == list(pair.prod.kv_cache.block_ids(pair.prod.transfers.held["p"]))
    assert params["num_tokens"] == len(PROMPT) and params["token_digest"] == token_digest(PROMPT, None)
    assert pair.prod.kv_cache.num_free_blocks == 64 - 5  # held for the consumer
    req = decode_request("d", PROMPT, params)
    pair.cons.add_request(req)
    pair.run()
    assert pair.outputs["d"] == reference_output(req)
    (load,) = pair.loads
    assert len(load.remote_block_ids) == len(load.local_block_ids) == 5
    # Only the prompt's last token was computed on the consumer, then the decodes.
    assert pair.cons_runner.num_tokens_computed == 1 + 5
    assert req.num_cached_tokens == 0
    pair.assert_all_free()


def test_a_prefix_cached_on_the_consumer_is_not_loaded():
    pair = Pair()
    local = decode_request("local", PROMPT[:8] + [7, 7, 7], None, max_tokens=2)
    pair.cons.add_request(local)
    pair.run()
    params = pair.prefill("p", PROMPT)
    req = decode_request("d", PROMPT, params)
    pair.cons.add_request(req)
    pair.run()
    (load,) = pair.loads
    assert load.remote_block_ids == tuple(params["remote_block_ids"][2:5])  # blocks 0 and 1 are cached
    assert pair.outputs["d"] == reference_output(req)
    pair.assert_all_free()


def test_a_consumer_with_everything_cached_releases_the_producer_at_once():
    pair = Pair()
    prompt = PROMPT[:17]  # the 16 tokens to load are 4 full blocks
    warm = decode_request("warm", prompt + [1, 2, 3], None, max_tokens=1)
    pair.cons.add_request(warm)
    pair.run()
    params = pair.prefill("p", prompt)
    req = decode_request("d", prompt, params)
    pair.cons.add_request(req)
    pair.run()
    assert not pair.loads and [r.request_id for r in pair.releases] == ["p"]
    assert pair.outputs["d"] == reference_output(req)
    pair.assert_all_free()


def test_a_failed_load_is_recomputed():
    pair = Pair(fail_loads=True)
    params = pair.prefill("p", PROMPT)
    pair._step(pair.prod, pair.prod_runner, 0)  # the hold reaches the worker half
    req = decode_request("d", PROMPT, params)
    pair.cons.add_request(req)
    while pair.cons.has_unfinished_requests():
        pair._step(pair.cons, pair.cons_runner, 1)
    assert pair.outputs["d"] == reference_output(req)
    assert pair.cons_runner.num_tokens_computed == len(PROMPT) + 5
    # The producer's blocks stay held (its lease frees them in the real worker half).
    assert pair.held == {"p": tuple(params["remote_block_ids"])}
    pair.prod.update_connector_output(KVConnectorOutput(finished_sending={"p"}))
    pair.held.clear()
    pair.assert_all_free()


def test_a_failed_load_fails_the_request_under_policy_fail():
    pair = Pair(fail_loads=True, policy="fail")
    params = pair.prefill("p", PROMPT)
    pair.cons.add_request(decode_request("d", PROMPT, params))
    for _ in range(3):
        pair._step(pair.cons, pair.cons_runner, 1)
    assert pair.finished["d"] is RequestStatus.FINISHED_ABORTED and pair.outputs["d"] == []
    assert pair.cons.kv_cache.num_free_blocks == 64 and not pair.cons.has_unfinished_requests()


def test_an_abort_while_loading_frees_blocks_only_when_the_load_ends():
    pair = Pair()
    params = pair.prefill("p", PROMPT)
    cons = pair.cons
    cons.add_request(decode_request("d", PROMPT, params))
    out = cons.schedule()  # admitted into the load; the worker half has not reported yet
    assert out.is_empty and len(out.kv_connector_metadata.loads) == 1
    assert cons.requests["d"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    cons.abort("d")
    cons.check_invariants()
    assert cons.kv_cache.num_free_blocks == 64 - 5  # the load may still be writing them
    cons.update_connector_output(KVConnectorOutput(finished_recving={"d"}))
    assert cons.kv_cache.num_free_blocks == 64 and not cons.has_unfinished_requests()
    cons.check_invariants()


def test_an_abort_before_the_load_releases_the_producer():
    pair = Pair()
    params = pair.prefill("p", PROMPT)
    pair.cons.add_request(decode_request("d", PROMPT, params))
    pair.cons.abort("d")
    pair.run()
    assert [r.request_id for r in pair.releases] == ["p"] and not pair.loads
    pair.assert_all_free()


def test_an_aborted_prefill_holds_nothing():
    sched = pd_scheduler("kv_producer")
    req = Request("p", PROMPT, 1, kv_transfer_params={"do_remote_decode": True})
    sched.add_request(req)
    sched.schedule()
    sched.abort("p")
    assert req.kv_transfer_result is None and not sched.has_connector_work()
    assert sched.kv_cache.num_free_blocks == 64


def test_a_different_prompt_does_not_load_anothers_blocks():
    pair = Pair()
    params = pair.prefill("p", PROMPT)
    other = PROMPT[:-1] + [5]
    req = decode_request("d", other, params)
    pair.cons.add_request(req)
    pair.run()
    assert not pair.loads and pair.outputs["d"] == reference_output(req)
    pair.assert_all_free()


@pytest.mark.parametrize("role, params, match", [
    ("kv_consumer", {"do_remote_decode": True}, "do_remote_decode needs kv_role kv_producer"),
    ("kv_producer", {"remote_block_ids": [1]}, "remote_block_ids needs kv_role kv_consumer"),
    ("kv_consumer", {"remote_block_ids": [-1]}, "kv_transfer_params.remote_block_ids must be"),
    ("kv_consumer", {"remote_block_ids": [1], "remote_engine_id": "e", "remote_host": "h", "remote_port": 70000},
     "kv_transfer_params.remote_port"),
    ("kv_consumer", {"remote_block_ids": [1], "remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                     "remote_request_id": "r", "num_tokens": 18, "token_digest": "0" * 64},
     "remote_block_ids holds 1 blocks; 18 tokens need 5"),
    ("kv_consumer", [1], "kv_transfer_params must be an object"),
])
def test_bad_transfer_params_are_refused_naming_the_key(role, params, match):
    sched = pd_scheduler(role)
    with pytest.raises(ValueError, match=match):
        sched.add_request(Request("r", PROMPT, 4, kv_transfer_params=params))
    assert not sched.requests


def test_transfer_params_without_a_connector_are_refused():
    with pytest.raises(ValueError, match="needs a KV connector"):
        make_scheduler().add_request(Request("r", PROMPT, 4, kv_transfer_params={"do_remote_decode": True}))


@pytest.mark.parametrize("value, match", [
    ('{"kv_role": "kv_both", "lease": 3}', "unknown keys"),
    ('{"kv_role": "prefill"}', "kv_role must be one of"),
    ('{"kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
    ('{"lease_seconds": 0}', "lease_seconds"),
    ('{"kv_port": 70000}', "kv_port"),
    ("{nope", "not valid JSON"),
])
def test_bad_kv_transfer_config_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.parse(value)
