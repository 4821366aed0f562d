"""Cache namespaces (tenants and adapters) and how blocks and pages are keyed in them.

An engine keeps the prefixes of requests with different ``cache_salt`` or LoRA adapter apart
(docs/DESIGN.md, "Tenants from credentials"), so the mirror
(:mod:`~contextpilot_integrations.sync.block_mirror`) does too. A block is keyed by
``(namespace, hash)`` (:func:`block_key`; the plain hash in the default namespace, no salt and
no adapter), the token index by ``(namespace's root or parent, page tokens)``
(:func:`root_key`), so a request registered in one namespace never matches a
chain stored in another (:mod:`~contextpilot_integrations.sync.request_attribution`), even
where the engine publishes the same hash for both (SGLang's hashes need not include the
salt). A ``BlockStored`` names its namespace by ``cache_salt`` (SGLang 0.5.18+), ``lora_name``
(or an old vLLM's ``lora_id``) and vLLM's ``extra_keys`` (:func:`event_namespace`); a store
that names none continues its parent's (:func:`inherit_namespace`: vLLM puts the salt on a
request's first block only). ``BlockRemoved`` carries no namespace: the mirror removes the
hash from every namespace holding it (exact where the engine's hashes are already namespaced,
conservative where they are not).

Public API: :class:`Namespace`, :data:`BlockKey`, :data:`TokenParent`,
:data:`AMBIGUOUS_NAMESPACE`, :func:`namespace_of`, :func:`block_key`, :func:`root_key`,
:func:`event_namespace`, :func:`inherit_namespace`.
"""

from __future__ import annotations

from typing import NamedTuple

from contextpilot_integrations.sync.kv_events import BlockHash, BlockStored

__all__ = [
    "AMBIGUOUS_NAMESPACE",
    "BlockKey",
    "Namespace",
    "TokenParent",
    "block_key",
    "event_namespace",
    "inherit_namespace",
    "namespace_of",
    "root_key",
]


class Namespace(NamedTuple):
    """Where cached blocks may be shared: requests share a cached prefix only within one
    namespace (the engines key their prefix caches the same way).

    Attributes:
        cache_salt: the tenant's ``cache_salt``, or None.
        adapter: the LoRA adapter's name (an event with only ``lora_id`` gives
            ``"lora-id:<id>"``, which no named request matches), or None.
        opaque: the chain's hash depends on more than tokens, salt and adapter (vLLM extra keys
            of images or prompt embeddings): no registered request's tokens match it.
    """

    cache_salt: str | None
    adapter: str | None
    opaque: bool = False


BlockKey = BlockHash | tuple[Namespace, BlockHash]
"""A block in the mirror: its hash in the default namespace, ``(namespace, hash)`` in another."""

TokenParent = BlockKey | tuple[Namespace, None] | None
"""What the token index keys a page under: its parent block, or its namespace's root."""

AMBIGUOUS_NAMESPACE = Namespace(None, None, opaque=True)
"""The namespace of a block whose parent hash several namespaces hold: opaque, so no registered
request's tokens match it."""


def namespace_of(cache_salt: str | None = None, adapter: str | None = None) -> Namespace | None:
    """The namespace of a request with this salt and LoRA adapter name; None: the default."""
    if cache_salt is None and adapter is None:
        return None
    return Namespace(cache_salt, adapter)


def block_key(namespace: Namespace | None, block_hash: BlockHash) -> BlockKey:
    """How the mirror keys ``block_hash`` (canonical form) in ``namespace``."""
    return block_hash if namespace is None else (namespace, block_hash)


def root_key(namespace: Namespace | None) -> TokenParent:
    """What the token index keys a namespace's first pages under (None: the default's)."""
    return None if namespace is None else (namespace, None)


def event_namespace(event: BlockStored) -> Namespace | None:
    """The namespace a ``BlockStored`` names, or None when it names none (what it does not
    name continues its parent's: :func:`inherit_namespace`).

    ``cache_salt`` is SGLang's field; vLLM puts the salt among the first block's
    ``extra_keys``, after the LoRA name: a lone string there is taken as the salt; any other
    extra key (an image's ``(identifier, offset)``, a digest) makes the namespace opaque.
    """
    name = event.lora_name
    adapter = name
    if adapter is None and event.lora_id is not None:
        adapter = f"lora-id:{event.lora_id}"
    salt = event.cache_salt
    opaque = False
    for extras in event.extra_keys or ():
        rest = list(extras or ())
        if name is not None and rest and rest[0] == name:
            rest = rest[1:]
        if not rest:
            continue
        if len(rest) == 1 and isinstance(rest[0], str) and salt in (None, rest[0]):
            salt = rest[0]
        else:
            opaque = True
    if salt is None and adapter is None and not opaque:
        return None
    return Namespace(salt, adapter, opaque)


def inherit_namespace(own: Namespace | None, parent: Namespace | None) -> Namespace | None:
    """``own`` with the parts it does not name taken from ``parent`` (opacity is kept)."""
    if parent is None:
        return own
    if own is None:
        return parent
    return Namespace(
        own.cache_salt if own.cache_salt is not None else parent.cache_salt,
        own.adapter if own.adapter is not None else parent.adapter,
        own.opaque or parent.opaque,
    )
