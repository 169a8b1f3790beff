"""The keys file of `--api-keys FILE`: tenants, their priority class and budgets, and the
API keys that name them, kept only as sha256 digests.

The file is YAML (so JSON too):

    tenants:
      interactive: {priority: 0, rpm: 600, tpm: 200000, max_concurrency: 16}
      batch: {priority: 10, tpm: 50000, max_concurrency: 4}
    keys:
      - {tenant: interactive, key_sha256: "9f86d081884c7d65..."}   # from `pagedserve keys hash`
      - {tenant: batch, key: "sk-batch-..."}                         # hashed on load, never kept

A tenant's fields are all optional: `priority` (default 0, lower runs first), `rpm`
(requests a minute), `tpm` (prompt and generated tokens a minute), `max_concurrency`
(requests in flight), each unlimited when absent, and `share_prefix_cache` (default
false: the tenant's prompts share prefix-cache blocks with its own requests only).
Several keys may name one tenant (rotation: add the new key, SIGHUP, retire the old).
"""
from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..core.validation import is_int

# Tenant names become metric labels and part of the cache salt.
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_BUDGETS = ("rpm", "tpm", "max_concurrency")
_TENANT_FIELDS = frozenset({"priority", "share_prefix_cache", *_BUDGETS})
# Salts of tenants that keep their prefixes to themselves start with this, those of tenants
# that share with "shared": no client-chosen salt can reach another tenant's blocks.
_OWN_SALT, _SHARED_SALT = "tenant\0", "shared\0"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: int = 0
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    share_prefix_cache: bool = False

    def request_priority(self, asked: int) -> int:
        """A request may ask to run after its tenant's class (a larger value), never before it."""
        return max(self.priority, asked)

    def cache_salt(self, asked: str | None) -> str | None:
        """The salt a request's prefix-cache blocks get: its tenant's own unless the tenant
        shares, the client's salt (if any) within it."""
        if self.share_prefix_cache:
            return None if asked is None else _SHARED_SALT + asked
        return f"{_OWN_SALT}{self.name}\0{asked or ''}"


def hash_key(key: str) -> str:
    """The sha256 hex digest the keys file stores for `key`."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyTable:
    """Key digests -> tenant names, and the tenants."""

    digests: tuple[tuple[bytes, str], ...]
    tenants: dict[str, Tenant]

    def lookup(self, key: bytes) -> Tenant | None:
        """The tenant whose key this is. The presented key's digest is compared with every
        stored one in constant time and without stopping at a match, so neither a key's
        bytes nor its position in the file show in how long the answer takes."""
        digest = hashlib.sha256(key).digest()
        found = None
        for stored, name in self.digests:
            if hmac.compare_digest(digest, stored):
                found = name
        return None if found is None else self.tenants[found]


def load_key_table(path: str | Path) -> KeyTable:
    """The keys file read and checked; a ValueError naming the file and the entry otherwise."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--api-keys {path}: cannot read it: {e}") from None
    try:
        return _table(doc)
    except ValueError as e:
        raise ValueError(f"--api-keys {path}: {e}") from None


def _table(doc: Any) -> KeyTable:
    if not isinstance(doc, dict) or set(doc) != {"tenants", "keys"}:
        raise ValueError("the file must hold a mapping with exactly two entries, 'tenants' and 'keys'")
    if not isinstance(doc["tenants"], dict) or not doc["tenants"]:
        raise ValueError("'tenants' must map at least one tenant name to its settings")
    tenants = {name: _tenant(name, fields) for name, fields in doc["tenants"].items()}
    if not isinstance(doc["keys"], list) or not doc["keys"]:
        raise ValueError("'keys' must be a list of at least one {tenant, key_sha256 or key}")
    digests: dict[bytes, str] = {}
    for i, entry in enumerate(doc["keys"]):
        digest, tenant = _key(i, entry, tenants)
        if digest in digests:
            raise ValueError(f"keys[{i}]: the same key is listed twice")
        digests[digest] = tenant
    return KeyTable(tuple(digests.items()), tenants)


def _tenant(name: Any, fields: Any) -> Tenant:
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r} must be 1-64 letters, digits, '_', '.' or '-' (not first)")
    fields = {} if fields is None else fields
    if not isinstance(fields, dict):
        raise ValueError(f"tenants.{name} must be a mapping of settings, got {fields!r}")
    unknown = sorted(set(fields) - _TENANT_FIELDS)
    if unknown:
        raise ValueError(f"tenants.{name} has unknown settings {unknown}; known: {sorted(_TENANT_FIELDS)}")
    if not is_int(fields.get("priority", 0)):
        raise ValueError(f"tenants.{name}.priority must be an integer, got {fields['priority']!r}")
    for budget in _BUDGETS:
        value = fields.get(budget)
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"tenants.{name}.{budget} must be an integer >= 1 (or absent: unlimited), got {value!r}")
    if not isinstance(fields.get("share_prefix_cache", False), bool):
        raise ValueError(f"tenants.{name}.share_prefix_cache must be true or false")
    return Tenant(name, **fields)


def _key(i: int, entry: Any, tenants: dict[str, Tenant]) -> tuple[bytes, str]:
    if not isinstance(entry, dict) or set(entry) not in ({"tenant", "key_sha256"}, {"tenant", "key"}):
        raise ValueError(f"keys[{i}] must be {{tenant, key_sha256}} or {{tenant, key}}")
    if entry["tenant"] not in tenants:
        raise ValueError(f"keys[{i}].tenant {entry['tenant']!r} is not one of the tenants {sorted(tenants)}")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or not key or key != key.strip():
            raise ValueError(f"keys[{i}].key must be a non-empty string without surrounding spaces")
        return bytes.fromhex(hash_key(entry["key"])), entry["tenant"]
    digest = entry["key_sha256"]
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
        raise ValueError(f"keys[{i}].key_sha256 must be 64 hex digits (`pagedserve keys hash` prints it)")
    return bytes.fromhex(digest), entry["tenant"]
