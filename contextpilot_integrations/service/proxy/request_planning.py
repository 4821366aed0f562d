"""The body a proxied call is sent with: its messages planned with the agent rules, the
engine's fields or the hosted API's cache controls added, and what the plan changed
(docs/DESIGN.md, "The proxy").

Per tenant one :class:`~contextpilot_integrations.core.messages.MessagePlanner` (tenant state
never crosses: a tenant's planner sees only its own conversations), and every conversation is
planned under ``Scope(tenant=<the key's tenant>, conversation_id=<conversation_key>)``.

What is added, by the upstream's kind (the functions of ``llm_call/``, as the LangChain agent
middleware adds them):

- ``"openai-compatible"``: :func:`~contextpilot_integrations.llm_call.engine_fields.
  engine_body_fields` of a new rid in the tenant's namespace (``rid``, ``request_id``,
  ``session_id``) and the tenant's ``cache_salt``; these replace any the client gave (a rid
  chosen by a client could collide in the engine's attribution, a salt chosen by one would
  cross the tenants' caches);
- ``"openai"``: ``prompt_cache_key`` per conversation (:func:`~contextpilot_integrations.
  llm_call.openai_cache_key.openai_cache_fields` of the conversation's hash and the tenant's
  salt), unless the client gave one;
- ``"anthropic"``: ``cache_control`` breakpoints from
  :func:`~contextpilot_integrations.llm_call.anthropic_breakpoints.anthropic_prompt` (after
  the system prompt, and where the conversation's history ends: the message before the last),
  within the limit of four counting the client's own, and none below the model's minimum.

The body extension ``contextpilot`` (an object; :data:`EXTENSION_FIELD`) is the proxy's and
is stripped before forwarding. Its fields: ``conversation_id`` (the conversation, when no
header names it); ``documents`` (the call's retrieved documents, relevance order) and ``query``
(their question), planned by the tenant's context index and put in front of the newest user
message (:mod:`.document_placement`). Anything else in it is refused (422), so a typo is not
silently ignored. Earlier user messages that went out with documents are put back as sent
before the messages are planned, on every call of a named conversation.

Bad input is :class:`BadRequest` naming the field: a body that is not JSON (400), not an
object, without a ``messages`` list, or messages the planner cannot read (422).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import msgspec

from contextpilot_integrations.core.messages import MessagePlan, MessagePlanner
from contextpilot_integrations.core.messages.message_shapes import (
    Api,
    validate_messages,
    validate_system,
)
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.replicas.replica_planning import ReplicaChoice
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import Scope, new_rid
from contextpilot_integrations.core.window.planning_window import PlanningWindow
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    AnthropicCachePolicy,
    anthropic_prompt,
)
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.engine_fields import engine_body_fields
from contextpilot_integrations.llm_call.openai_cache_key import openai_cache_fields
from contextpilot_integrations.service.proxy.conversation_key import (
    ConversationSource,
    conversation_key,
)
from contextpilot_integrations.service.proxy.document_placement import (
    DocumentError,
    DocumentMemory,
    DocumentPlacer,
    DocumentRequest,
    PlacedDocuments,
    read_documents,
)
from contextpilot_integrations.service.proxy.proxy_config import UpstreamKind
from contextpilot_integrations.service.tenants import Tenancy

__all__ = ["EXTENSION_FIELD", "BadRequest", "PreparedCall", "ProxyPlanning", "report_headers"]

logger = logging.getLogger(__name__)

EXTENSION_FIELD = "contextpilot"
"""The body field the proxy reads and strips (module docstring)."""

_EXTENSION_KEYS = frozenset({"conversation_id", "documents", "query"})


class BadRequest(Exception):
    """A request the proxy refuses before forwarding it.

    Attributes:
        status: 400 (not JSON) or 422 (a field at fault).
        message: names the field and the value.
        field: the field's path (``messages[3].content``), or ``None``.
    """

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


@dataclass(frozen=True, slots=True)
class _CallIds:
    """What :func:`engine_body_fields` reads of a plan: one call's rid and the tenant's salt."""

    rid: str
    cache_salt: str | None


@dataclass(frozen=True)
class PreparedCall:
    """One call as it is forwarded.

    Attributes:
        body: the JSON body to send upstream.
        rid: the engine-facing rid (the tenant's rid tag, a dot, a new rid).
        scope: the conversation (tenant and conversation id).
        source: where the conversation id came from (:mod:`.conversation_key`).
        plan: the message plan.
        breakpoints: ``cache_control`` breakpoints the proxy placed (``"anthropic"`` only).
        documents: the call's documents as planned and placed (``None``: none given).
        restored: earlier messages put back as they were sent with documents.
        replica: the replica the call goes to, with a fleet (``None``: one upstream).
    """

    body: bytes
    rid: str
    scope: Scope
    source: ConversationSource
    plan: MessagePlan
    breakpoints: int = 0
    documents: PlacedDocuments | None = None
    restored: int = 0
    replica: ReplicaChoice | None = None


class ProxyPlanning:
    """Plans the proxied calls of every tenant.

    Args:
        tenancy: the service's tenants (rid tags, cache salts).
        kind: the upstream's kind (what is added to the body: module docstring).
        new_planner: makes a tenant's planner (default ``MessagePlanner()``).
        record: called with ``(tenant, rid, scope, plan, documents)`` once a call is prepared
            (the service's running totals; ``documents`` the pilot's plan of the call's
            documents, which counted itself, or ``None``); its errors are logged, never
            raised.
        pilot_of: a tenant's pilot, which plans the documents marked in a body (``None``:
            documents are refused, 422); with a fleet, the tenant's replica router (the
            documents' plan then names the replica); either behind a planning window when
            the service has one.
        new_memory: makes a tenant's memory of messages sent with documents.
        route: with a fleet, the replica of a call without documents, ``(tenant, rid,
            scope, prompt tokens) -> ReplicaChoice`` (:mod:`.replica_routing`).
        undo: called with ``(tenant, rid)`` when a call is refused (or fails) once its
            documents may have been planned: its plan is undone (index entry, the replica's
            ticket and load) at once, so no later call waits for it.
    """

    def __init__(
        self,
        tenancy: Tenancy,
        kind: UpstreamKind,
        *,
        new_planner: Callable[[], MessagePlanner] = MessagePlanner,
        record: Callable[[str | None, str, Scope, MessagePlan, Plan | None], None] | None = None,
        pilot_of: Callable[[str | None], ContextPilot | ReplicaRouter | PlanningWindow]
        | None = None,
        new_memory: Callable[[], DocumentMemory] = DocumentMemory,
        route: Callable[[str | None, str, Scope, int], ReplicaChoice] | None = None,
        undo: Callable[[str | None, str], None] | None = None,
    ) -> None:
        self._route = route
        self._undo = undo
        self.tenancy = tenancy
        self.kind = kind
        self._new_planner = new_planner
        self._record = record
        self._pilot_of = pilot_of
        self._new_memory = new_memory
        self._planners: dict[str | None, MessagePlanner] = {}
        self._memories: dict[str | None, DocumentMemory] = {}
        self._lock = threading.Lock()

    def planner_of(self, tenant: str | None) -> MessagePlanner:
        """``tenant``'s planner (``None``: the one caller of a service without keys); made on
        first use. Tenants are the configured ones, so this is bounded."""
        with self._lock:
            planner = self._planners.get(tenant)
            if planner is None:
                planner = self._planners[tenant] = self._new_planner()
            return planner

    def memory_of(self, tenant: str | None) -> DocumentMemory:
        """``tenant``'s memory of messages sent with documents (tenants never share one);
        made on first use."""
        with self._lock:
            memory = self._memories.get(tenant)
            if memory is None:
                memory = self._memories[tenant] = self._new_memory()
            return memory

    def prepare(
        self, raw: bytes, api: Api, tenant: str | None, session_header: str | None
    ) -> PreparedCall:
        """The call to forward for a client's raw body (blocking: run it in a worker thread).

        Args:
            raw: the client's body.
            api: ``"openai"`` (``/v1/chat/completions``) or ``"anthropic"`` (``/v1/messages``).
            tenant: the tenant of the request's key (``None`` on a service without keys).
            session_header: the conversation header's value, if given.

        Raises:
            BadRequest: the body is refused (module docstring).
        """
        body, plain = _decoded(raw)
        if not isinstance(body, dict):
            raise BadRequest(422, f"body must be a JSON object, got {type(body).__name__}", "body")
        extension = body.pop(EXTENSION_FIELD, None)
        if extension is not None and not isinstance(extension, dict):
            raise BadRequest(
                422,
                f"{EXTENSION_FIELD} must be an object, got {type(extension).__name__}: "
                f"{extension!r:.80}",
                EXTENSION_FIELD,
            )
        unknown = sorted(set(extension or {}) - _EXTENSION_KEYS)
        if unknown:
            raise BadRequest(
                422,
                f"{EXTENSION_FIELD} has unknown fields {unknown!r:.200}; known: "
                f"{sorted(_EXTENSION_KEYS)}",
                f"{EXTENSION_FIELD}.{unknown[0]}",
            )
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest(
                422, f"messages must be a list of messages, got {messages!r:.80}", "messages"
            )
        try:
            wanted = read_documents(extension or {})
        except DocumentError as exc:
            raise BadRequest(422, str(exc)[:1000], exc.field) from None
        system = body.get("system") if api == "anthropic" else None
        rid = self._engine_rid(tenant)
        try:
            return self._planned(body, plain, api, tenant, session_header, extension, wanted,
                                 system, rid)  # fmt: skip
        except BaseException:
            # Refused (or failed) once the documents may be planned: undone at once, so the
            # replica's door does not hold later calls for a ticket that never comes.
            if wanted is not None and self._undo is not None:
                self._undo(tenant, rid)
            raise

    def _planned(
        self,
        body: dict[str, Any],
        plain: bool,
        api: Api,
        tenant: str | None,
        session_header: str | None,
        extension: dict[str, Any] | None,
        wanted: DocumentRequest | None,
        system: Any,
        rid: str,
    ) -> PreparedCall:
        """:meth:`prepare` from the planning on."""
        messages = body["messages"]
        try:
            key, source = conversation_key(
                session_header, (extension or {}).get("conversation_id"), body, api
            )
            scope = Scope(conversation_id=key, tenant=tenant or "")
            remember = source != "opening"
            placer = self._placer(tenant, wanted is not None)
            placed: PlacedDocuments | None = None
            if wanted is not None:
                assert placer is not None
                # Shapes first: the pilot indexes the documents, so a body the planner
                # refuses must be refused before.
                validate_messages(messages, api)
                validate_system(system, api)
                placed = placer.place(
                    wanted, messages, api, rid=rid, scope=scope, remember=remember, system=system
                )
                given, restored = placed.messages, placed.substituted
            elif placer is not None and remember:
                given, _, restored = placer.restore(messages, api, key, system)
            else:
                given, restored = messages, 0
            plan = self.planner_of(tenant).plan(given, scope=scope, api=api, system=system)
        except DocumentError as exc:
            raise BadRequest(422, str(exc)[:1000], exc.field) from None
        except (TypeError, ValueError) as exc:
            message = str(exc)
            raise BadRequest(422, message[:1000], message.split(" ", 1)[0]) from None
        if placed is not None and placer is not None:
            placer.commit(placed)
        body["messages"] = plan.messages
        breakpoints = self._add_fields(body, api, rid, tenant, scope)
        encoded = _encoded_plain(body) if plain else None
        if encoded is None:
            encoded = _encoded(body)
        replica = self._replica(tenant, rid, scope, encoded, placed)
        if self._record is not None:
            try:
                self._record(tenant, rid, scope, plan, placed.plan if placed else None)
            except Exception:
                logger.exception("recording the proxy's plan %s failed", rid)
        return PreparedCall(
            encoded, rid, scope, source, plan, breakpoints, placed, restored, replica
        )

    def _replica(
        self,
        tenant: str | None,
        rid: str,
        scope: Scope,
        encoded: bytes,
        placed: PlacedDocuments | None,
    ) -> ReplicaChoice | None:
        """With a fleet, where the call goes: where its documents were planned, else
        :meth:`ReplicaRouter.route` of the call (its size estimated from the body)."""
        if self._route is None:
            return None
        replica = placed.plan.replica if placed is not None else None
        if placed is not None and replica is not None:
            return ReplicaChoice(replica, placed.plan.routing_key, placed.plan.base_url)
        counter = self.planner_of(tenant).token_counter
        return self._route(tenant, rid, scope, counter.count(encoded.decode("utf-8", "replace")))

    def _placer(self, tenant: str | None, needed: bool) -> DocumentPlacer | None:
        """The tenant's placer; ``None`` without a pilot (documents then refused) or, when
        not ``needed``, while the tenant never placed any (nothing to put back)."""
        if self._pilot_of is None:
            if needed:
                raise DocumentError(
                    f"{EXTENSION_FIELD}.documents: this proxy has no context index to plan "
                    "documents with"
                )
            return None
        if not needed:
            with self._lock:
                if tenant not in self._memories:
                    return None
        return DocumentPlacer(self._pilot_of(tenant), self.memory_of(tenant))

    def _engine_rid(self, tenant: str | None) -> str:
        tag = self.tenancy.rid_tag(tenant) if tenant is not None else ""
        rid = new_rid()
        return f"{tag}.{rid}" if tag else rid

    def _salt(self, tenant: str | None) -> str | None:
        return self.tenancy.cache_salt(tenant) if tenant is not None else None

    def _add_fields(
        self, body: dict[str, Any], api: Api, rid: str, tenant: str | None, scope: Scope
    ) -> int:
        """Add the upstream's fields to ``body`` in place; the breakpoints placed."""
        salt = self._salt(tenant)
        if self.kind == "openai-compatible":
            body.update(engine_body_fields(_CallIds(rid, salt), "any"))
            return 0
        if self.kind == "openai":
            if api == "openai" and "prompt_cache_key" not in body:
                body.update(openai_cache_fields(_conversation_prefix(scope, salt)))
            return 0
        if api != "anthropic":
            return 0
        return _add_breakpoints(body, self.planner_of(tenant))


def _decoded(raw: bytes) -> tuple[Any, bool]:
    """The client's body read, and whether it is plain: read by msgspec (several times
    faster than :mod:`json` on a long history), which refuses what JSON's grammar does and
    more (``NaN``, a lone surrogate escape, a number past a float's range); such a body is read
    by :mod:`json` as before, and is not plain.

    Raises:
        BadRequest: not JSON (400).
    """
    try:
        return msgspec.json.decode(raw), True
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested too deep
        pass
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite), False
    except (ValueError, RecursionError) as exc:
        raise BadRequest(400, f"body: cannot be read as JSON ({exc})", "body") from None


def _no_constant(name: str) -> float:
    """``NaN``, ``Infinity``, ``-Infinity`` are not JSON: refused, so none goes upstream,
    where a strict parser (a gateway's, an engine's) would refuse the whole body."""
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """A JSON number as a float, refused past a double's range (``1e999`` would go upstream
    as ``Infinity``, which is not JSON)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of a double's range")
    return value


def _encoded_plain(body: dict[str, Any]) -> bytes | None:
    """A plain body (:func:`_decoded`) as UTF-8 JSON by msgspec: the same values as
    :func:`_encoded` gives, ``None`` where msgspec cannot write one (then :func:`_encoded`).
    Only for plain bodies: msgspec writes a NaN as ``null``, which such a body cannot hold."""
    try:
        return msgspec.json.encode(body)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        return None


def _encoded(body: dict[str, Any]) -> bytes:
    """``body`` as UTF-8 JSON. A lone surrogate (JSON allows ``"\\ud800"``; Python reads it
    into a str) goes out as the same ``\\uXXXX`` escape the client sent, so the bytes are
    valid UTF-8: surrogates occur only inside JSON strings, where ``backslashreplace`` writes
    exactly that escape."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


def _conversation_prefix(scope: Scope, salt: str | None) -> CachePrefix:
    """A :class:`CachePrefix` naming the conversation by a hash of tenant and id (what the
    LangChain middleware keys OpenAI's cache by)."""
    tenant, conversation = scope.tenant, scope.conversation_id or ""
    digest = hashlib.blake2b(
        f"{tenant}\x00{conversation}".encode("utf-8", "surrogatepass"), digest_size=8
    ).digest()
    return CachePrefix((), block_ids=(int.from_bytes(digest, "big"),), salt=salt)


def _add_breakpoints(body: dict[str, Any], planner: MessagePlanner) -> int:
    """Anthropic breakpoints placed in ``body`` (system and messages replaced); 0 where the
    request already holds as many as allowed or has a shape they cannot go in."""
    model = body.get("model")
    policy = AnthropicCachePolicy(model=model if isinstance(model, str) else None)
    system = body.get("system")
    messages: list[dict[str, Any]] = list(body["messages"])
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tools = body.get("tools")
    try:
        prompt = anthropic_prompt(
            messages,
            None,
            policy,
            planner.token_counter,
            tools=tools if isinstance(tools, list) else (),
        )
    except (TypeError, ValueError) as exc:
        logger.debug("no breakpoints: %s", exc)
        return 0
    if not prompt.breakpoints:
        return 0
    body["messages"] = prompt.messages
    if prompt.system is not None:
        body["system"] = prompt.system
    return len(prompt.breakpoints)


def report_headers(call: PreparedCall) -> list[tuple[bytes, bytes]]:
    """What the proxy found and changed, as answer headers (values ASCII; the conversation
    id percent-encoded)."""
    plan = call.plan
    pointers = plan.pointers
    documents = call.documents
    placed_tokens = documents.tokens_removed if documents is not None else 0
    values = {
        "x-contextpilot-rid": call.rid,
        "x-contextpilot-conversation": quote(call.scope.conversation_id or "", safe=":-_."),
        "x-contextpilot-conversation-source": call.source,
        "x-contextpilot-replayed": str(plan.replayed),
        "x-contextpilot-pointers": str(len(pointers)),
        "x-contextpilot-new-pointers": str(sum(1 for p in pointers if not p.replayed)),
        "x-contextpilot-tokens-removed": str(plan.tokens_removed + placed_tokens),
    }
    if call.breakpoints:
        values["x-contextpilot-breakpoints"] = str(call.breakpoints)
    if call.restored:
        values["x-contextpilot-restored"] = str(call.restored)
    if documents is not None:
        values["x-contextpilot-documents"] = str(len(documents.plan.placements))
        values["x-contextpilot-documents-shown"] = str(documents.shown)
        values["x-contextpilot-documents-replaced"] = str(documents.replaced)
        values["x-contextpilot-documents-reordered"] = "true" if documents.reordered else "false"
        values["x-contextpilot-documents-prefix-tokens"] = str(documents.plan.matched_prefix_tokens)
    return [(k.encode("ascii"), v.encode("ascii")) for k, v in values.items()]
