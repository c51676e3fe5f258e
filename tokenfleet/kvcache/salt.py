"""Who may reuse whose cached KV blocks: the salt of a request's block-hash chain.

Two requests share cached blocks only when their chains have the same salt: the replica's layout
salt (model version, dtype, block size: ``KVLayout.hash_salt``) joined with the request's *scope*.
The scope names who may share: the tenant's share group (by default the tenant alone; tenants can
opt in to one group, e.g. one company's keys), the request's own ``cache_salt`` (a client keeping
two of its users apart, as vLLM's field does) and, when adapters exist, the LoRA adapter. The
gateway computes the scope once per request (``request_scope``) and sends it with the request; the
router, the workers and the simulator derive the chain salt from it (``chain_salt``). A scope is a
digest: arbitrary client text never reaches a worker's logs, and its length is fixed.

Without isolation tenant A could test whether tenant B sent a prefix (cached-token counts and
time to first token reveal a hit at block granularity); with it, a hit is always one's own.
"""

from __future__ import annotations

import hashlib

SCOPE_CHARS = 32


def request_scope(share_group: str, cache_salt: str = "", adapter: str = "") -> str:
    """The scope of a request: "" only when all three are empty (a single-tenant cluster)."""
    if not (share_group or cache_salt or adapter):
        return ""
    payload = "\x00".join(("tokenfleet-scope-v1", share_group, cache_salt, adapter)).encode()
    return hashlib.sha256(payload).hexdigest()[:SCOPE_CHARS]


def adapter_scope(scope: str, adapter: str) -> str:
    """The scope of a request run with LoRA ``adapter``: its KV differs from the base model's. The engine applies
    it to every request it is given with an adapter; a gateway asking a router to place one passes the same."""
    return f"{scope}\x00lora:{adapter}" if adapter else scope


def chain_salt(layout_salt: str, scope: str) -> str:
    """The salt a request's block hashes start from (``block_hash.root_hash``)."""
    return f"{layout_salt}\x00scope={scope}" if scope else layout_salt


def conversation_key(scope: str, key: str, tenant: str = "") -> str:
    """A conversation's key as the router and the engine see it: the client's key (``prompt_cache_key``, a stored
    response chain's first id) digested with the request's scope and its tenant, so that one tenant's key never
    names another's conversation (not even in a shared cache group, whose tenants share a scope) and client text
    never reaches a worker."""
    payload = "\x00".join(("tokenfleet-conversation-v1", scope, tenant, key)).encode()
    return hashlib.sha256(payload).hexdigest()[:SCOPE_CHARS]
