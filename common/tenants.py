"""Tenants: who may call the API, with which key, under which limits and share of the fleet. Read from
the keys file (`OPENJEV_API_KEYS_FILE`, TOML, one `[tenants.NAME]` table each), or one tenant from
`OPENJEV_API_KEY`, or, with neither, one open tenant that every caller is.

    [tenants.search]
    key = "sk-search-..."                 # or key_sha256 = "<hex of sha256(key)>", so the file holds no key
    requests_per_minute = 600             # submissions (POST /v1/systemone, POST /v1/jobs), refilled evenly
    burst = 50                            # how many of them may come at once (default: requests_per_minute)
    max_concurrent_jobs = 64              # jobs not yet ended, sync and async
    max_queued_jobs = 10000               # async jobs not yet ended
    weight = 2                            # share of queued work against other tenants' (default 1)
    operator = true                       # may read /metrics (every tenant's counters)

Keys are compared in constant time (each presented key's SHA-256 against every tenant's, with no early
exit), and never kept in clear once the file is read."""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"  # the tenant of OPENJEV_API_KEY, and of every caller when no key is set
TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a metrics label and a Redis key part: no ':' or spaces
MIN_KEY_LENGTH = 16
LIMIT_FIELDS = ("requests_per_minute", "burst", "max_concurrent_jobs", "max_queued_jobs")
FIELDS = frozenset({"key", "key_sha256", "weight", "operator", *LIMIT_FIELDS})


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; None: unlimited."""

    requests_per_minute: int | None = None
    burst: int | None = None  # submissions at once (None: requests_per_minute)
    max_concurrent_jobs: int | None = None
    max_queued_jobs: int | None = None


@dataclass(frozen=True)
class Tenant:
    """One client of the service."""

    name: str
    key_sha256: bytes | None  # None: the open tenant (no key configured at all)
    limits: TenantLimits = TenantLimits()
    weight: float = 1.0  # its share of queued work, against the other tenants' weights
    operator: bool = False  # may read /metrics, which shows every tenant's counters


OPEN_TENANT = Tenant(DEFAULT_TENANT, None, operator=True)


def key_digest(key: bytes | str) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class TenantDirectory:
    """The tenants in force; `authenticate` maps a presented key to its tenant."""

    def __init__(self, tenants: list[Tenant], source: Path | None = None) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.source = source
        self.open = len(tenants) == 1 and tenants[0].key_sha256 is None
        # the tenants' weights together where they share the queue (0 for one tenant: the queue is its own)
        self.shared_weight = sum(t.weight for t in tenants) if len(tenants) > 1 else 0.0

    @classmethod
    def single(cls, key: str | None) -> TenantDirectory:
        """One tenant holding `key` (OPENJEV_API_KEY), or the open tenant when there is no key."""
        if key is None:
            return cls([OPEN_TENANT])
        return cls([Tenant(DEFAULT_TENANT, key_digest(key), operator=True)])

    @classmethod
    def from_file(cls, path: Path) -> TenantDirectory:
        """Read and check the keys file; KeysFileError (naming the line) if it cannot be used."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"{path}: cannot be read ({exc})") from exc
        return cls(parse_keys_file(text, str(path)), path)

    def authenticate(self, key: bytes) -> Tenant | None:
        """The tenant whose key is `key`, or None. Every tenant's digest is compared, whatever matches."""
        digest = key_digest(key)
        found = None
        for tenant in self.tenants.values():
            if tenant.key_sha256 is not None and hmac.compare_digest(digest, tenant.key_sha256):
                found = tenant
        return found

    @property
    def names(self) -> list[str]:
        return sorted(self.tenants)


def parse_keys_file(text: str, where: str) -> list[Tenant]:
    """The tenants of a keys file's `text`; KeysFileError naming `where` and the line at fault."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"{where}: not valid TOML: {exc}") from exc
    unknown = set(document) - {"tenants"}
    if unknown:
        first = sorted(unknown)[0]
        raise KeysFileError(f"{where}: line {_line_of(text, first, table=None)}: unknown top-level entry {first!r}; "
                            "only [tenants.NAME] tables belong here")
    tables = document.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise KeysFileError(f"{where}: no tenants; add at least one [tenants.NAME] table with a key")
    tenants = [_tenant(name, table, text, where) for name, table in tables.items()]
    seen: dict[bytes, str] = {}
    for tenant in tenants:
        assert tenant.key_sha256 is not None
        if tenant.key_sha256 in seen:
            raise KeysFileError(f"{where}: line {_line_of(text, tenant.name)}: tenant {tenant.name!r} "
                                f"has the same key as {seen[tenant.key_sha256]!r}; each tenant needs its own key")
        seen[tenant.key_sha256] = tenant.name
    return tenants


def _tenant(name: str, table: Any, text: str, where: str) -> Tenant:
    line = _line_of(text, name)

    def fault(message: str) -> KeysFileError:
        return KeysFileError(f"{where}: line {line}: [tenants.{name}]: {message}")

    if not TENANT_NAME.fullmatch(name):
        raise fault("a tenant name is 1-64 letters, digits, '_' or '-'")
    if not isinstance(table, dict):
        raise fault("must be a table")
    unknown = set(table) - FIELDS
    if unknown:
        raise fault(f"unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(FIELDS))}")
    if ("key" in table) == ("key_sha256" in table):
        raise fault("set exactly one of `key` and `key_sha256`")
    if "key" in table:
        key = table["key"]
        if not isinstance(key, str) or len(key) < MIN_KEY_LENGTH or key != key.strip() or " " in key:
            raise fault(f"`key` must be a string of at least {MIN_KEY_LENGTH} characters, without spaces")
        digest = key_digest(key)
    else:
        hex_digest = table["key_sha256"]
        if not isinstance(hex_digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", hex_digest):
            raise fault("`key_sha256` must be 64 hex digits: the SHA-256 of the key (`sha256sum`)")
        digest = bytes.fromhex(hex_digest)
    limits = {}
    for field in LIMIT_FIELDS:
        value = table.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise fault(f"`{field}` must be a whole number of at least 1 (leave it out for no limit)")
        limits[field] = value
    if limits["burst"] is not None and limits["requests_per_minute"] is None:
        raise fault("`burst` needs `requests_per_minute`")
    weight = table.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1000:
        raise fault("`weight` must be a number above 0 and at most 1000")
    operator = table.get("operator", False)
    if not isinstance(operator, bool):
        raise fault("`operator` must be true or false")
    return Tenant(name, digest, TenantLimits(**limits), float(weight), operator)


def _line_of(text: str, name: str, table: str | None = "tenants") -> int:
    """The line (1-based) where `name` is declared: the tenant table `[tenants.NAME]` (or a dotted
    `tenants.NAME.field = ...`), quoted or not; with `table` None, a top-level key or table. 1 if not found."""
    n = re.escape(name)
    named = rf"""(?:"{n}"|'{n}'|{n})"""
    dotted = named if table is None else rf"{table}[ \t]*\.[ \t]*{named}"
    pattern = re.compile(rf"^[ \t]*(\[[ \t]*{dotted}[ \t]*[\].]|{dotted}[ \t]*[=.])", re.MULTILINE)
    match = pattern.search(text)
    return text.count("\n", 0, match.start()) + 1 if match else 1
