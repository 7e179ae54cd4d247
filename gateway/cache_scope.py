"""Which requests share prefix-cache pages: the gateway's --prefix-cache-scope, as the salt each request's pages are
keyed under (common/page_pool.py).

A request whose prompt starts with pages already cached gets its first token sooner and says
so in its usage (`cached_tokens`). Where two clients share pages, each can so learn whether
the other sent a given start of a prompt (a guessed secret in a system prompt, say): the
prompt-leakage side channel of a shared KV cache. A salt closes it between requests that do
not share one, at the price of the reuse between them.

- `global`: one cache for every request without a `cache_salt`, so anyone who can reach the
  gateway can probe it; a request with a `cache_salt` shares only with requests that send
  the same one (vLLM's meaning).
- `salt`: nothing is shared without a salt: a request without one shares pages only with
  its own copies (n, best_of); requests with the same `cache_salt` share.
- `tenant`: only requests made with the same API key share pages (gateway/access.py), a
  `cache_salt` then dividing a tenant's cache further; the gateway needs keys to start with it.

The salts of the three kinds never meet: a client's salt cannot name another request's own.
"""

from __future__ import annotations

from typing import Literal, assert_never

from gateway.request import Submission

CacheScope = Literal["global", "salt", "tenant"]
UNSALTED = ""  # the page pool's cache every unsalted request shares


def page_salt(scope: CacheScope, submission: Submission) -> str:
    """The salt the submission's pages are keyed under."""
    client = submission.cache_salt
    match scope:
        case "global":
            return UNSALTED if client is None else f"salt:{client}"
        case "salt":
            return f"request:{submission.own_salt}" if client is None else f"salt:{client}"
        case "tenant":
            if submission.tenant is None:  # the ports check keys before any request is made
                raise ValueError("--prefix-cache-scope tenant: a request without a tenant (no API key checked)")
            tenant = f"tenant:{submission.tenant}"
            return tenant if client is None else f"{tenant}/salt:{client}"
        case _:
            assert_never(scope)
