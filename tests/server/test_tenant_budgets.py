"""The keys file, key lookup and the tenants' budgets, without a server (a fake clock)."""
from __future__ import annotations

import json

import pytest

from pagedserve.http import tenant_keys
from pagedserve.http.tenant_keys import Tenant, hash_key, load_key_table
from pagedserve.http.tenants import Tenants, TenantState

KEY_A, KEY_B, KEY_B2 = "sk-alpha-1", "sk-beta-1", "sk-beta-2"


def keys_file(tmp_path, doc, name="keys.yaml"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


GOOD_YAML = f"""
tenants:
  alpha: {{priority: 0, rpm: 2, tpm: 100, max_concurrency: 1}}
  beta: {{priority: 5, share_prefix_cache: true}}
keys:
  - {{tenant: alpha, key_sha256: "{hash_key(KEY_A)}"}}
  - {{tenant: beta, key: "{KEY_B}"}}
  - {{tenant: beta, key_sha256: "{hash_key(KEY_B2).upper()}"}}
"""


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_key_names_its_tenant_and_plain_keys_are_not_kept(tmp_path):
    table = load_key_table(keys_file(tmp_path, GOOD_YAML))
    assert table.lookup(KEY_A.encode()).name == "alpha"
    assert table.lookup(KEY_B.encode()).name == table.lookup(KEY_B2.encode()).name == "beta"
    assert table.lookup(b"sk-alpha-") is None and table.lookup(b"") is None
    assert table.tenants["alpha"] == Tenant("alpha", 0, rpm=2, tpm=100, max_concurrency=1)
    assert KEY_B not in repr(table) and KEY_B.encode() not in b"".join(d for d, _ in table.digests)


def test_json_is_read_too(tmp_path):
    doc = {"tenants": {"t": None}, "keys": [{"tenant": "t", "key": "k1"}]}
    assert load_key_table(keys_file(tmp_path, doc, "keys.json")).lookup(b"k1").name == "t"


def test_every_stored_digest_is_compared_whatever_matches(tmp_path, monkeypatch):
    table = load_key_table(keys_file(tmp_path, GOOD_YAML))
    calls = []
    real = tenant_keys.hmac.compare_digest
    monkeypatch.setattr(tenant_keys.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    for key in (KEY_A, "nope", KEY_B2):
        table.lookup(key.encode())
    assert calls == [(32, 32)] * 9


BAD = [
    ("[]", "exactly two entries"),
    ("tenants: {a: {}}\nkeys: []\nextra: 1", "exactly two entries"),
    ("tenants: {}\nkeys: [{tenant: a, key: k}]", "at least one tenant"),
    ("tenants: {a: {}}\nkeys: []", "at least one"),
    ("tenants: {'-a': {}}\nkeys: [{tenant: -a, key: k}]", "tenant name"),
    ("tenants: {a: {rpm: 0}}\nkeys: [{tenant: a, key: k}]", "tenants.a.rpm must be an integer >= 1"),
    ("tenants: {a: {tpm: true}}\nkeys: [{tenant: a, key: k}]", "tenants.a.tpm"),
    ("tenants: {a: {priority: high}}\nkeys: [{tenant: a, key: k}]", "tenants.a.priority"),
    ("tenants: {a: {budget: 3}}\nkeys: [{tenant: a, key: k}]", "unknown settings ['budget']"),
    ("tenants: {a: {}}\nkeys: [{tenant: b, key: k}]", "keys[0].tenant 'b' is not one of"),
    ("tenants: {a: {}}\nkeys: [{tenant: a, key_sha256: abc}]", "keys[0].key_sha256 must be 64 hex"),
    ("tenants: {a: {}}\nkeys: [{tenant: a, key: k, key_sha256: abc}]", "keys[0] must be"),
    ("tenants: {a: {}}\nkeys: [{tenant: a, key: ' k'}]", "surrounding spaces"),
    ("tenants: {a: {}}\nkeys: [{tenant: a, key: k}, {tenant: a, key: k}]", "keys[1]: the same key"),
    ("tenants: {a: {}\n", "cannot read it"),
]


@pytest.mark.parametrize(("doc", "message"), BAD, ids=[m for _, m in BAD])
def test_a_bad_file_is_refused_naming_the_problem(tmp_path, doc, message):
    path = keys_file(tmp_path, doc)
    with pytest.raises(ValueError, match="--api-keys .*" + message.replace("[", r"\[").replace("]", r"\]")):
        load_key_table(path)


def test_priority_class_and_cache_salt():
    alpha, beta = Tenant("alpha", priority=3), Tenant("beta", share_prefix_cache=True)
    assert alpha.request_priority(0) == 3 and alpha.request_priority(7) == 7  # later, never earlier
    assert alpha.cache_salt(None) != Tenant("alpha2").cache_salt(None)
    assert alpha.cache_salt("x") != alpha.cache_salt(None)
    assert beta.cache_salt(None) is None
    # A client's salt on a sharing tenant never reaches another tenant's own blocks.
    assert beta.cache_salt(alpha.cache_salt(None)) != alpha.cache_salt(None)


def test_rpm_refuses_until_the_bucket_refills():
    clock = Clock()
    state = TenantState.new(Tenant("t", rpm=2), clock)
    assert state.admit() is None and state.admit() is None
    refusal = state.admit()
    assert (refusal.budget, refusal.retry_after_s) == ("rpm", 30)
    clock.now += 29.0
    assert state.admit().retry_after_s == 1
    clock.now += 1.0
    assert state.admit() is None
    assert state.requests == 3 and state.refused["rpm"] == 2


def test_tokens_overdraw_tpm_and_the_debt_is_repaid_before_the_next_request():
    clock = Clock()
    state = TenantState.new(Tenant("t", tpm=600), clock)  # 10 tokens a second
    assert state.admit() is None
    state.charge_prompt(500)
    state.charge_generated(400)  # 300 below zero: 30 s of refill to get back to 1 token
    refusal = state.admit()
    assert refusal.budget == "tpm" and refusal.retry_after_s == 31
    clock.now += 30.2
    assert state.admit() is None
    assert (state.prompt_tokens, state.generation_tokens) == (500, 400)


def test_concurrency_cap_holds_until_release():
    state = TenantState.new(Tenant("t", max_concurrency=1), Clock())
    assert state.admit() is None
    assert state.admit().budget == "concurrency"
    state.release()
    assert state.admit() is None and state.in_flight == 1


def test_reload_swaps_keys_and_keeps_usage_and_a_bad_file_changes_nothing(tmp_path):
    path = keys_file(tmp_path, GOOD_YAML)
    tenants = Tenants(path, Clock())
    scope = {"headers": [(b"authorization", b"Bearer " + KEY_A.encode())]}
    state = tenants.authenticate(scope)
    state.charge_prompt(7)
    path.write_text("tenants: {alpha: {rpm: 5}}\nkeys: [{tenant: alpha, key: sk-new}]")
    assert tenants.reload()
    assert tenants.authenticate(scope) is None
    new = tenants.authenticate({"headers": [(b"x-api-key", b"sk-new")]})
    assert new is state and state.prompt_tokens == 7 and state.tenant.rpm == 5 and state.tpm is None
    path.write_text("tenants: [")
    assert not tenants.reload()
    assert tenants.authenticate({"headers": [(b"x-api-key", b"sk-new")]}) is state


def test_one_key_and_a_keys_file_do_not_go_together():
    from pagedserve.entrypoints.openai.args import ServerConfig

    with pytest.raises(ValueError, match="--api-keys do not go together"):
        ServerConfig(api_key="sk-x", api_keys="keys.yaml")
