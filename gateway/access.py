"""Who may use the public ports: the API keys (`--api-key`, `--api-key-file`), each the identity of a tenant.

Without keys the ports take anyone (for a loopback-only or otherwise fenced deployment). With
them, every HTTP request but the probes' (`/health`, `/ready`) carries `Authorization: Bearer
KEY`, and every SpecServe RPC the same as gRPC metadata; anything else gets 401 /
UNAUTHENTICATED, the same answer for a missing key and a wrong one. A presented key is compared
with every key, each through its SHA-256 digest with `hmac.compare_digest`, so the time taken
tells neither which key came close nor how long a key is.

A key is a tenant: its requests are told apart from other keys' by the tenant id, a digest of
the key (never the key itself, which is never logged), which `--prefix-cache-scope tenant`
keys prefix-cache pages under (gateway/cache_scope.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

OPEN_PATHS = frozenset({"/health", "/ready"})  # HTTP routes that want no key: the probes'
ENV_VAR = "SPECSERVE_API_KEY"  # one key, for deployments that pass secrets in the environment
HEADER = "authorization"  # HTTP header and gRPC metadata key alike (gRPC metadata keys are lower case)
_SCHEME = "bearer"
_TENANT_DIGITS = 16  # hex digits of a key's digest that name its tenant
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))  # printable ASCII without spaces: a header's token


class ApiKeyError(ValueError):
    """A key or key file that cannot be used; the message says which and why."""


def key_problem(key: str) -> str:
    """Why `key` cannot be an API key ("" when it can)."""
    if not key:
        return "an API key must not be empty"
    if not set(key) <= _KEY_CHARS:
        return "an API key must be printable ASCII without spaces (it travels in an Authorization header)"
    return ""


def keys_from_file(path: Path) -> list[str]:
    """The keys in a file: one a line; blank lines and lines starting with # are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ApiKeyError(f"--api-key-file {path}: cannot be read ({error})") from error
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ApiKeyError(f"--api-key-file {path}: holds no key")
    return keys


@dataclass(frozen=True)
class ApiKeys:
    """The digests of the keys callers may present; none: the ports are open to anyone."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        digests = []
        for key in keys:
            if problem := key_problem(key):
                raise ApiKeyError(problem)
            digests.append(hashlib.sha256(key.encode()).digest())
        return cls(tuple(dict.fromkeys(digests)))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of the key an Authorization value (`Bearer KEY`) presents; None for no key or a wrong one, and
        always None where no keys are required (the caller is nobody in particular)."""
        if not self.required or authorization is None:
            return None
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != _SCHEME:
            return None
        digest = hashlib.sha256(presented.strip().encode("utf-8", "surrogatepass")).digest()
        found: bytes | None = None
        for known in self.digests:  # every key compared, a match or not: the time says nothing of which
            if hmac.compare_digest(digest, known):
                found = known
        return None if found is None else tenant_id(found)


def tenant_id(digest: bytes) -> str:
    """The name a key's requests go by: the first hex digits of a digest of the key's digest (so that neither the key
    nor its digest can be read from a salt or a log line)."""
    return hashlib.sha256(b"specserve tenant " + digest).hexdigest()[:_TENANT_DIGITS]


def api_keys(keys: Sequence[str], key_file: Path | None, *, environ: dict[str, str] | None = None) -> ApiKeys:
    """The keys given on the command line, in the file and in SPECSERVE_API_KEY, all of them accepted."""
    environment = os.environ if environ is None else environ
    every = list(keys)
    if key_file is not None:
        every += keys_from_file(key_file)
    if environment.get(ENV_VAR):
        every.append(environment[ENV_VAR])
    return ApiKeys.of(every)
