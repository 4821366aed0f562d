"""``contextpilot-server``: run the index service with uvicorn.

Examples::

    # beside an SGLang or vLLM engine started with --kv-events-config (see the README)
    contextpilot-server --port 8765 \\
        --kv-events tcp://127.0.0.1:5557 --kv-events-replay tcp://127.0.0.1:5558 \\
        --snapshot /var/lib/contextpilot/index.json

    # an engine that publishes nothing: a 200k-token capacity model
    contextpilot-server --cache-model capacity --capacity-tokens 200000

    # a hosted API with prompt caching
    contextpilot-server --cache-model ttl --ttl-provider openai

    # the proxy mode: apps point their OpenAI or Anthropic SDK here instead of at the engine
    contextpilot-server --upstream http://127.0.0.1:8000/v1 --cache-model capacity \\
        --capacity-tokens 200000
    OPENAI_API_KEY=... contextpilot-server --upstream https://api.openai.com/v1 \\
        --upstream-api-key-env OPENAI_API_KEY --cache-model ttl --ttl-provider openai

    # the proxy in front of two vLLM replicas (the router hosted here, each replica's KV events)
    contextpilot-server --replica http://127.0.0.1:8001/v1 --replica http://127.0.0.1:8002/v1 \\
        --replica-kv-events tcp://127.0.0.1:5557 --replica-kv-events tcp://127.0.0.1:5559 \\
        --kv-events-topic kv-events
    # ... or behind smg routing on the routing key (--upstream is then the gateway)
    contextpilot-server --upstream http://127.0.0.1:30000/v1 \\
        --replica http://127.0.0.1:8001/v1 --replica http://127.0.0.1:8002/v1 \\
        --replica-kv-events tcp://127.0.0.1:5557 --replica-kv-events tcp://127.0.0.1:5559

    # two proxy processes that plan as one (a balancer, or clients, spread calls over them)
    export CONTEXTPILOT_PEER_SECRET=...  # the same on both
    contextpilot-server --port 8801 --upstream http://127.0.0.1:8000/v1 \\
        --peer http://10.0.0.1:8801 --peer http://10.0.0.2:8801 --peer-self http://10.0.0.1:8801

    # tenants: each key belongs to one tenant (format in service/tenants.py)
    contextpilot-server --api-keys /etc/contextpilot/keys.json --snapshot /var/lib/cp/index.json
    CONTEXTPILOT_API_KEYS="alice=<key>,bob=<key>" contextpilot-server

Keys: ``--api-keys FILE`` (a JSON key file) and/or the environment variable
``CONTEXTPILOT_API_KEYS`` map keys to tenants (:mod:`.tenants`; each tenant gets its own index
unless ``--share-prefixes-across-tenants``); one key shared by everyone comes
from ``--api-key`` or, better (a command line is visible to other users),
``CONTEXTPILOT_API_KEY``, and is the tenant ``""``. A key source that is given but holds no
key (a key file naming no tenant, an empty variable or ``--api-key ""``) is refused at start,
naming it: the server would otherwise trust every request. With no key source at all the
service runs without authentication; ``--no-auth`` says so explicitly (logged at warning level,
and refused beside a key source). One process holds the index: uvicorn runs
one worker, and many app processes share it through
:class:`~contextpilot_integrations.client.client.ContextPilotClient`. SIGTERM or Ctrl-C stops
it gracefully: in-flight requests get ``--shutdown-timeout`` seconds to finish, then planning
stops and the final snapshot is saved, within another ``--shutdown-timeout`` even if a call is
stuck.

Proxy mode (``--upstream URL``; docs/DESIGN.md, "The proxy"): the same process, tenants,
snapshot and engine link also serve ``POST /v1/chat/completions`` and ``POST /v1/messages``,
planned and forwarded to the upstream, and pass every other ``/v1/`` path through. The
upstream's key comes from ``--upstream-api-key-env NAME`` (the variable's value) or
``--upstream-api-key-file PATH`` (the file's first line), never from the command line; with
``--pass-client-key`` each client's own ``Authorization`` / ``x-api-key`` go upstream instead.
On a service with keys the client's bearer key is its tenant key and is not forwarded (unless
``--pass-client-key``; a client then gives its tenant key as ``x-contextpilot-api-key``).

Replicas (``--replica URL`` repeated, or ``--replicas-config FILE``, the fleet mapping of
:mod:`.proxy.fleet_config`): the proxy hosts the replica router. Without ``--upstream`` each call
goes to its replica's URL (the ``"direct"`` mode); with it, ``--upstream`` is a gateway (smg)
routing on the ``x-contextpilot-route`` key (the ``"gateway"`` mode). ``--replica-kv-events``
gives the replicas' KV-event endpoints, in the same order (topic ``--kv-events-topic``). Each
replica's KV capacity is asked of its engine at start (:mod:`.proxy.kv_capacity`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from contextpilot_integrations import __version__
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.window.planning_window import MAX_WINDOW_MS
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.header_deadline import HeaderDeadlineProtocol
from contextpilot_integrations.service.proxy.peer_config import PEER_SECRET_ENV, PeerConfig
from contextpilot_integrations.service.proxy.proxy_config import UPSTREAM_KINDS, ProxyConfig
from contextpilot_integrations.service.service_config import MAX_WINDOW_BATCH, ServiceConfig
from contextpilot_integrations.service.tenants import TenantKeys, parse_key_list, read_key_file

logger = logging.getLogger("contextpilot_integrations.service.server")  # also as __main__

API_KEY_ENV = "CONTEXTPILOT_API_KEY"
API_KEYS_ENV = "CONTEXTPILOT_API_KEYS"
DEFAULT_PORT = 8765
KEEP_ALIVE_SECONDS = 75
"""How long an idle client connection stays open. Longer than the clients' own pool expiry
(httpx, and so the openai and anthropic SDKs, drop idle connections after 5 s): with equal
timeouts a client can send a request on a connection the server is closing that instant, and
the request fails with a read error without an answer."""
_CACHE_MODELS = {"events": "kv-events", "capacity": "capacity", "ttl": "ttl"}


MAX_SECONDS = 7 * 24 * 3600.0
"""The longest of the seconds flags (timeouts, a TTL): a week."""

MAX_CONNECTIONS = 65_535
"""The most upstream connections (``--upstream-connections``, the tenant share) and calls in
flight per replica: one host's ports to one upstream address."""

_INT = re.compile(r"-?[0-9]+")
_HEADER_SAFE_KEY = re.compile(r"[\x21-\x7e]+")
"""An upstream key as it can go in a header: visible ASCII, no space or control character
(a CR/LF would split the header; a space would be sent as part of the key)."""
_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
"""A flag's number as written: ASCII digits, no spaces, ``_`` or ``+`` (which Python's ``int``
and ``float`` take), so a mistyped value is refused rather than read as another."""


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """argparse type: an int from ``low`` to ``high`` (argparse names the flag)."""

    def parse(text: str) -> int:
        value = int(text) if _INT.fullmatch(text) else None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an int >= {low} (at most {high}), got {text!r:.40}"
            )
        return value

    parse.__name__ = "int"
    return parse


_port = _int_in(0, 65535)
"""argparse type: a TCP port, 0 (any free port) to 65535."""


def _seconds(text: str) -> float:
    """argparse type: a number of seconds > 0, at most :data:`MAX_SECONDS`."""
    value = _finite(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a number > 0 (seconds, at most {MAX_SECONDS:g}), got {text!r:.40}"
        )
    return value


def _milliseconds(text: str) -> float:
    """argparse type: a number of milliseconds from 0 to a planning window's longest."""
    value = _finite(text)
    if not 0 <= value <= MAX_WINDOW_MS:
        raise argparse.ArgumentTypeError(
            f"must be a number from 0 to {MAX_WINDOW_MS:g}, got {text!r:.40}"
        )
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or (math.isfinite(value) and not _NUMBER.fullmatch(text)):
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r:.40}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r:.40}")
    return value


_TOKENS = 2**40
"""The most tokens a count flag takes (a KV cache far past any engine's)."""

_connections = _int_in(1, MAX_CONNECTIONS)


def _zmq_endpoint(text: str) -> str:
    """argparse type: a ZMQ endpoint the engines publish on (tcp://HOST:PORT or ipc://PATH)."""
    if not (text.startswith("tcp://") and ":" in text[len("tcp://") :]) and not (
        text.startswith("ipc://") and len(text) > len("ipc://")
    ):
        raise argparse.ArgumentTypeError(f"must be tcp://HOST:PORT or ipc://PATH, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``contextpilot-server``."""
    parser = argparse.ArgumentParser(
        prog="contextpilot-server",
        description="Serve one shared ContextPilot index over HTTP, following the engine's "
        "KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help="port (default 8765)")

    sync = parser.add_argument_group("engine sync")
    sync.add_argument(
        "--cache-model",
        choices=sorted(_CACHE_MODELS),
        help="where evictions come from: the engine's KV events, a capacity model (engines "
        "that publish nothing) or a TTL model (hosted APIs); default: events with "
        "--kv-events, else none (the index's own LRU bound only)",
    )
    sync.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        type=_zmq_endpoint,
        help="the engine's KV-event publisher, tcp://HOST:PORT or ipc://PATH (its "
        "--kv-events-config endpoint)",
    )
    sync.add_argument(
        "--kv-events-replay", metavar="ENDPOINT", type=_zmq_endpoint, help="its replay_endpoint"
    )
    sync.add_argument("--kv-events-topic", default="", help="its topic (vLLM: kv-events)")
    sync.add_argument(
        "--dp-size", type=_int_in(1, 1024), default=1, help="data-parallel ranks to follow"
    )
    sync.add_argument(
        "--page-size", type=_int_in(1, 65536), help="engine page size (default: from events)"
    )
    sync.add_argument(
        "--capacity-tokens", type=_int_in(1, _TOKENS), help="capacity model: KV cache tokens"
    )
    sync.add_argument(
        "--ttl-provider",
        choices=["openai", "anthropic", "anthropic-1h"],
        help="TTL model: the provider's documented cache lifetime",
    )
    sync.add_argument("--ttl-seconds", type=_seconds, help="TTL model: lifetime in seconds")
    sync.add_argument(
        "--min-cached-tokens", type=_int_in(0, _TOKENS), help="TTL model: shortest cached prompt"
    )
    sync.add_argument(
        "--engine-grace",
        type=_seconds,
        metavar="SECONDS",
        help="events: seconds the publisher may stay unconnected before it counts as "
        "unreachable (default 5)",
    )

    state = parser.add_argument_group("index and state")
    state.add_argument(
        "--snapshot",
        metavar="PATH",
        type=Path,
        help="restore the index from PATH on start (then resync with the engine), save on shutdown",
    )
    state.add_argument(
        "--snapshot-interval",
        type=_seconds,
        metavar="SECONDS",
        help="also save a checkpoint every SECONDS (survives a hard kill; conversations "
        "restored from a checkpoint keep their turn numbers, not their records)",
    )
    state.add_argument(
        "--max-requests", type=_int_in(1, 10**9), default=100_000, help="index LRU bound"
    )
    state.add_argument(
        "--layout",
        type=Path,
        metavar="JSON",
        help="a JSON file of PromptLayout fields (system_prompt, block_template, ...)",
    )

    proxy = parser.add_argument_group("proxy mode")
    proxy.add_argument(
        "--upstream",
        metavar="URL",
        help="serve /v1/chat/completions and /v1/messages planned, and pass every other /v1/ "
        "path through, to this engine or hosted API (its base URL, with or without /v1)",
    )
    proxy.add_argument(
        "--upstream-kind",
        choices=list(UPSTREAM_KINDS),
        help="what the upstream takes: engine fields (openai-compatible: SGLang, vLLM, a "
        "gateway), a prompt_cache_key (openai) or cache_control breakpoints (anthropic); "
        "default: from the URL (api.openai.com, api.anthropic.com, else openai-compatible)",
    )
    proxy.add_argument(
        "--upstream-api-key-env",
        metavar="NAME",
        help="the environment variable holding the upstream's API key",
    )
    proxy.add_argument(
        "--upstream-api-key-file",
        metavar="PATH",
        type=Path,
        help="a file whose first line is the upstream's API key",
    )
    proxy.add_argument(
        "--pass-client-key",
        action="store_true",
        help="forward each client's own Authorization / x-api-key upstream instead of the "
        "proxy's key (with tenant keys, clients then send theirs as x-contextpilot-api-key)",
    )
    proxy.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="an engine replica's base URL (repeat for each; named replica-0, replica-1, ...): "
        "the proxy routes each call to one; with --upstream, the gateway in front of them",
    )
    proxy.add_argument(
        "--replica-kv-events",
        action="append",
        type=_zmq_endpoint,
        metavar="ENDPOINT",
        help="the KV-event endpoint of each --replica, in the same order",
    )
    proxy.add_argument(
        "--replicas-config",
        type=Path,
        metavar="JSON",
        help="a JSON file of the fleet: mode (direct, gateway), replicas (name, base_url, "
        'cache_sync, kv_capacity_tokens: "auto" asks the engine, default; N tokens; null '
        "off), load, max_imbalance, retry_down_s, ordered, max_in_flight, window_hold_ms, "
        "target_workers",
    )
    proxy.add_argument(
        "--replica-order",
        choices=("schedule", "arrival"),
        default=None,
        help="how calls with documents go out to each replica: schedule (in the order their "
        "plans were handed out, each once the previous one started its answer; an answer "
        "that is not streamed starts when whole) or arrival (default: as they come)",
    )
    proxy.add_argument(
        "--replica-max-in-flight",
        type=_connections,
        default=None,
        metavar="N",
        help="most calls with documents out at once per replica (default: no cap)",
    )
    proxy.add_argument(
        "--window-hold-ms",
        type=_milliseconds,
        default=None,
        metavar="MS",
        help="hold a planning window (--window-ms) open up to MS milliseconds past its length "
        "while every replica has calls with documents waiting at its door (--replica-order "
        "schedule or --replica-max-in-flight): they would wait there anyway, and planned "
        "together they share more (default 0: never held)",
    )
    proxy.add_argument(
        "--target-workers",
        action="store_true",
        default=None,
        help="behind SMG run with --policy consistent_hashing: send each call to its "
        "replica's worker (x-smg-target-worker), each replica's worker index learnt from "
        "the gateway's answers first (default: the routing key alone)",
    )
    proxy.add_argument(
        "--upstream-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="longest wait for the upstream's next bytes (default 600)",
    )
    proxy.add_argument(
        "--peer",
        action="append",
        metavar="URL",
        help="a proxy process of the group that plans as one (repeat for each, this one "
        f"included, the same list on each; the shared secret in ${PEER_SECRET_ENV}): each "
        "call is planned by the process that owns its conversation",
    )
    proxy.add_argument(
        "--peer-self",
        metavar="URL",
        help="which of the --peer URLs this process is",
    )
    proxy.add_argument(
        "--upstream-connections",
        type=_connections,
        metavar="N",
        help="connections to the upstream at most (a pool; one per replica with --replica; "
        "default 512)",
    )
    proxy.add_argument(
        "--upstream-tenant-connections",
        type=_connections,
        metavar="N",
        help="with several tenants, the most of those connections one tenant's calls hold "
        "(default: three quarters of --upstream-connections, one fewer at least), so one "
        "tenant never takes the last ones another needs; a freed connection goes to the "
        "waiting tenant holding the fewest",
    )
    proxy.add_argument(
        "--upstream-pool-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="longest wait of a call for a free upstream connection; then a 503 with "
        "Retry-After, nothing sent (default 10)",
    )

    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--api-keys",
        metavar="FILE",
        type=Path,
        help='tenant keys, a JSON file {"tenants": {"<name>": {"keys": ["..."], '
        f'"cache_salt": "..."}}}} (also ${API_KEYS_ENV}="name=key,..."); each request runs '
        "as its key's tenant",
    )
    serving.add_argument(
        "--share-prefixes-across-tenants",
        action="store_true",
        help="one index for all tenants (prefix reuse across tenants; a tenant can then tell "
        "from matched_prefix_blocks whether another sent a document; no cache_salt)",
    )
    serving.add_argument(
        "--api-key",
        help=f"one shared secret, the tenant '' (default: ${API_KEY_ENV}; no key at all: no auth)",
    )
    serving.add_argument(
        "--no-auth",
        action="store_true",
        help="run without authentication (every request trusted; logged as a warning); "
        "refused with any key option or variable",
    )
    serving.add_argument(
        "--window-ms",
        type=_milliseconds,
        default=0.0,
        metavar="MS",
        help="plan single requests arriving within MS milliseconds of each other jointly "
        "(a planning window; default 0: each at once)",
    )
    serving.add_argument(
        "--window-max-batch",
        type=_int_in(1, MAX_WINDOW_BATCH),
        default=64,
        metavar="N",
        help="most requests one planning window gathers; a full window closes at once "
        "(default 64; the proxy keeps twice as many worker threads for calls waiting in "
        "windows)",
    )
    serving.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM: for in-flight requests, then again for the final save (default 10)",
    )
    serving.add_argument(
        "--max-body-bytes",
        type=_int_in(1, 2**30),
        default=64 * 1024 * 1024,
        help="largest request body",
    )
    serving.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
    )
    serving.add_argument("--access-log", action="store_true", help="log every request")
    serving.add_argument(
        "--gc-walk-all-every",
        type=_int_in(0, 10**6),
        default=8,
        metavar="N",
        help="freeze what survives each full garbage collection out of the next ones, and let "
        "every N-th walk everything again (reference cycles among long-lived objects wait up "
        "to N full passes); 0: Python's own full passes (default 8)",
    )
    return parser


def config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> ServiceConfig:
    """The :class:`ServiceConfig` the parsed arguments describe.

    Raises:
        ValueError: inconsistent options (the message names them).
    """
    model = args.cache_model or ("events" if args.kv_events else None)
    cache_sync: dict[str, Any] | None = None
    if model == "events":
        if not args.kv_events:
            raise ValueError("--cache-model events needs --kv-events ENDPOINT")
        cache_sync = {
            "kind": "kv-events",
            "endpoint": args.kv_events,
            "replay_endpoint": args.kv_events_replay,
            "topic": args.kv_events_topic,
            "dp_size": args.dp_size,
            "page_size": args.page_size,
            "max_requests": args.max_requests,
        }
        if args.engine_grace is not None:
            cache_sync["engine_grace_s"] = args.engine_grace
    elif model == "capacity":
        if args.capacity_tokens is None:
            raise ValueError("--cache-model capacity needs --capacity-tokens N")
        cache_sync = {"kind": "capacity", "capacity_tokens": args.capacity_tokens}
    elif model == "ttl":
        if args.ttl_provider is None and args.ttl_seconds is None:
            raise ValueError("--cache-model ttl needs --ttl-provider or --ttl-seconds")
        cache_sync = {
            "kind": "ttl",
            "provider": args.ttl_provider,
            "ttl_s": args.ttl_seconds,
            "min_cached_tokens": args.min_cached_tokens,
            "max_requests": args.max_requests,
        }
    if model != "events" and (
        args.kv_events_replay
        or args.kv_events
        or args.engine_grace is not None
        or (args.kv_events_topic and not args.replica_kv_events)  # the replicas' topic too
        or args.dp_size != 1
    ):
        raise ValueError(
            f"--kv-events options, --dp-size and --engine-grace need --cache-model events, "
            f"got {model!r}"
        )
    # A model's own options beside another model would be read by nobody.
    for option, value, needs in (
        ("--capacity-tokens", args.capacity_tokens, "capacity"),
        ("--ttl-provider", args.ttl_provider, "ttl"),
        ("--ttl-seconds", args.ttl_seconds, "ttl"),
        ("--min-cached-tokens", args.min_cached_tokens, "ttl"),
    ):
        if value is not None and model != needs:
            raise ValueError(f"{option} needs --cache-model {needs}, got {model!r}")
    layout = None
    if args.layout is not None:
        try:
            layout = PromptLayout(**json.loads(args.layout.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"--layout {str(args.layout)!r}: {exc}") from exc
    api_key, tenants = _keys(args, environ)
    proxy = _proxy(args, environ)
    return ServiceConfig(
        cache_sync=cache_sync,
        snapshot_path=args.snapshot,
        snapshot_interval_s=args.snapshot_interval,
        max_requests=args.max_requests,
        layout=layout,
        api_key=api_key,
        tenants=tenants or None,
        share_prefixes_across_tenants=args.share_prefixes_across_tenants,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        window_ms=args.window_ms,
        window_max_batch=args.window_max_batch,
        proxy=proxy,
    )


def _proxy(args: argparse.Namespace, environ: dict[str, str]) -> ProxyConfig | None:
    """The proxy mode's settings, or ``None`` without ``--upstream``.

    Raises:
        ValueError: proxy options without ``--upstream``, a key source that is unset, empty
            or unreadable, two key sources, or a key source beside ``--pass-client-key``.
    """
    given = [
        name
        for name, present in (
            ("--upstream-kind", args.upstream_kind is not None),
            ("--upstream-api-key-env", args.upstream_api_key_env is not None),
            ("--upstream-api-key-file", args.upstream_api_key_file is not None),
            ("--pass-client-key", args.pass_client_key),
            ("--peer", bool(args.peer)),
            ("--peer-self", args.peer_self is not None),
            ("--upstream-timeout", args.upstream_timeout is not None),
            ("--upstream-connections", args.upstream_connections is not None),
            ("--upstream-tenant-connections", args.upstream_tenant_connections is not None),
            ("--upstream-pool-timeout", args.upstream_pool_timeout is not None),
        )
        if present
    ]
    fleet = _fleet(args)
    if args.upstream is None and fleet is None:
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(
                f"{', '.join(given)} {verb} --upstream URL (or --replica / --replicas-config)"
            )
        return None
    if args.upstream_api_key_env is not None and args.upstream_api_key_file is not None:
        raise ValueError("give the upstream's key by --upstream-api-key-env or by "
                         "--upstream-api-key-file, not both")  # fmt: skip
    key: str | None = None
    if args.upstream_api_key_env is not None:
        key = environ.get(args.upstream_api_key_env)
        if not key:
            raise ValueError(
                f"--upstream-api-key-env: the variable ${args.upstream_api_key_env} is unset or "
                "empty"
            )
        if not _HEADER_SAFE_KEY.fullmatch(key):
            raise ValueError(
                f"--upstream-api-key-env: the variable ${args.upstream_api_key_env} holds "
                "whitespace or control characters (a key goes in a header as it is)"
            )
    elif args.upstream_api_key_file is not None:
        try:
            lines = args.upstream_api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"--upstream-api-key-file {str(args.upstream_api_key_file)!r}: cannot be read "
                f"({type(exc).__name__})"
            ) from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(
                f"--upstream-api-key-file {str(args.upstream_api_key_file)!r}: the first line "
                "is empty"
            )
        if not _HEADER_SAFE_KEY.fullmatch(key):
            raise ValueError(
                f"--upstream-api-key-file {str(args.upstream_api_key_file)!r}: the first line "
                "holds whitespace or control characters (a key goes in a header as it is)"
            )
    if key is not None and args.pass_client_key:
        raise ValueError(
            "--pass-client-key forwards the clients' keys: drop --upstream-api-key-env / "
            "--upstream-api-key-file"
        )
    peers = PeerConfig.from_arguments(args.peer or [], args.peer_self, environ)
    tenant_connections = args.upstream_tenant_connections
    connections = _or(args.upstream_connections, ProxyConfig.max_connections)
    if tenant_connections is not None and tenant_connections > connections:
        raise ValueError(
            f"--upstream-tenant-connections {tenant_connections} is over "
            f"--upstream-connections {connections}"
        )
    try:
        return ProxyConfig(
            args.upstream,
            kind=args.upstream_kind,
            api_key=key,
            pass_client_key=args.pass_client_key,
            read_timeout_s=_or(args.upstream_timeout, ProxyConfig.read_timeout_s),
            max_connections=connections,
            max_tenant_connections=tenant_connections,
            pool_timeout_s=_or(args.upstream_pool_timeout, ProxyConfig.pool_timeout_s),
            fleet=fleet,  # type: ignore[arg-type]  # the mapping is checked there
            peers=peers,
        )
    except ValueError as exc:
        where = "--replicas-config" if args.replicas_config is not None else "--replica"
        raise ValueError(f"{where if fleet is not None else '--upstream'}: {exc}") from None


_T = TypeVar("_T")


def _or(given: _T | None, default: _T) -> _T:
    """A flag's value, ``default`` where it was left out (the config's own default)."""
    return default if given is None else given


def _fleet(args: argparse.Namespace) -> dict[str, Any] | None:
    """The fleet mapping of ``--replica`` / ``--replica-kv-events`` or ``--replicas-config``
    (its mode from ``--upstream``: a gateway with it, direct without); None without either.

    Raises:
        ValueError: both given, endpoints without replicas or not one per replica, or a
            config file that cannot be read as a JSON object.
    """
    urls, endpoints = args.replica or [], args.replica_kv_events or []
    if args.replicas_config is not None:
        if urls or endpoints:
            raise ValueError("give the replicas by --replica or by --replicas-config, not both")
        try:
            fleet = json.loads(
                args.replicas_config.read_text(encoding="utf-8"),
                object_pairs_hook=_unique_keys,
            )
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"--replicas-config {str(args.replicas_config)!r}: cannot be read ({exc})"
            ) from None
        if not isinstance(fleet, dict):
            raise ValueError(
                f"--replicas-config {str(args.replicas_config)!r}: must hold a JSON object"
            )
        fleet.setdefault("mode", "gateway" if args.upstream is not None else "direct")
        for key, flag, value in (
            ("ordered", "--replica-order", args.replica_order),
            ("max_in_flight", "--replica-max-in-flight", args.replica_max_in_flight),
            ("window_hold_ms", "--window-hold-ms", args.window_hold_ms),
            ("target_workers", "--target-workers", args.target_workers),
        ):
            if key in fleet and value is not None:  # one source of truth for each setting
                raise ValueError(
                    f"--replicas-config {str(args.replicas_config)!r} gives {key} and {flag} "
                    "is given too: give it in one place"
                )
        return _with_door(fleet, args)
    if endpoints and len(endpoints) != len(urls):
        raise ValueError(
            f"--replica-kv-events: {len(endpoints)} given for {len(urls)} --replica; give one "
            "per replica, in the same order"
        )
    if not urls:
        door = [
            name
            for name, value in (
                ("--replica-order", args.replica_order),
                ("--replica-max-in-flight", args.replica_max_in_flight),
                ("--window-hold-ms", args.window_hold_ms),
                ("--target-workers", args.target_workers),
            )
            if value is not None
        ]
        if door:
            raise ValueError(f"{door[0]} needs replicas (--replica or --replicas-config)")
        return None
    replicas: list[dict[str, Any]] = []
    for i, url in enumerate(urls):
        replica: dict[str, Any] = {"name": f"replica-{i}", "base_url": url}
        if endpoints:
            replica["cache_sync"] = {
                "kind": "kv-events",
                "endpoint": endpoints[i],
                "topic": args.kv_events_topic,
            }
        replicas.append(replica)
    mode = "gateway" if args.upstream is not None else "direct"
    return _with_door({"mode": mode, "replicas": replicas}, args)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (``json`` keeps the last one
    silently, so one of two settings would be dropped unseen)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object")
        out[key] = value
    return out


def _with_door(fleet: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``fleet`` with ``--replica-order``, ``--replica-max-in-flight``, ``--window-hold-ms``
    and ``--target-workers`` where given."""
    if args.replica_order is not None:
        fleet["ordered"] = args.replica_order == "schedule"
    if args.replica_max_in_flight is not None:
        fleet["max_in_flight"] = args.replica_max_in_flight
    if args.window_hold_ms is not None:
        fleet["window_hold_ms"] = args.window_hold_ms
        if args.window_hold_ms > 0 and args.window_ms == 0:
            raise ValueError(
                f"--window-hold-ms {args.window_hold_ms:g} holds planning windows: give "
                "--window-ms > 0 too"
            )
        if args.window_hold_ms > 0 and not fleet.get("ordered") and not fleet.get("max_in_flight"):
            raise ValueError(
                f"--window-hold-ms {args.window_hold_ms:g} holds a window while calls wait at "
                "the replicas' door: give --replica-order schedule or --replica-max-in-flight "
                "N too (or ordered / max_in_flight in --replicas-config)"
            )
    if args.target_workers is not None:
        fleet["target_workers"] = args.target_workers
    return fleet


def _keys(
    args: argparse.Namespace, environ: dict[str, str]
) -> tuple[str | None, dict[str, TenantKeys]]:
    """The shared key and the tenants' keys of every key source given.

    A source given without a key would leave the service open, so it is refused, named;
    ``--no-auth`` beside any key source is refused too (which one is meant?).

    Raises:
        ValueError: a key source without a key, an invalid one, or ``--no-auth`` with one.
    """
    given = [
        name
        for name, present in (
            ("--api-keys", args.api_keys is not None),
            ("--api-key", args.api_key is not None),
            (f"${API_KEYS_ENV}", API_KEYS_ENV in environ),
            (f"${API_KEY_ENV}", API_KEY_ENV in environ),
        )
        if present
    ]
    if args.no_auth:
        if given:
            raise ValueError(
                f"--no-auth runs without authentication, but keys are given by "
                f"{', '.join(given)}: drop one or the other"
            )
        logger.warning(
            "--no-auth: authentication is off; every request is trusted and scope.tenant is "
            "a label, not a security boundary"
        )
        return None, {}
    api_key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV)
    if api_key is not None:
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        if not api_key:
            raise ValueError(
                f"{source} is set but empty, so no request could be checked{_OPEN_HINT}"
            )
        try:
            TenantKeys((api_key,))
        except ValueError:
            raise ValueError(
                f"{source} must be printable ASCII characters without whitespace (the key "
                "travels in an HTTP header as Bearer <key>)"
            ) from None
    tenants: dict[str, TenantKeys] = {}
    if args.api_keys is not None:
        tenants.update(read_key_file(args.api_keys))
        if not tenants:
            raise ValueError(
                f"key file {str(args.api_keys)!r} names no tenant, so no request could be "
                f"checked{_OPEN_HINT}"
            )
    if API_KEYS_ENV in environ:
        listed_tenants = parse_key_list(environ[API_KEYS_ENV])
        if not listed_tenants:
            raise ValueError(
                f"${API_KEYS_ENV} is set but lists no name=key entry, so no request could be "
                f"checked{_OPEN_HINT}"
            )
        for name, listed in listed_tenants.items():
            known = tenants.get(name)
            keys = (*(known.keys if known else ()), *listed.keys)
            salt = known.cache_salt if known else None
            tenants[name] = TenantKeys(tuple(dict.fromkeys(keys)), salt)
    return api_key, tenants


_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts only this machine reaches: a service without keys bound to one is not open to others."""

_OPEN_HINT = " (to run without authentication, pass --no-auth and no key option or variable)"


class FreezeSurvivors:
    """A ``gc.callbacks`` hook that freezes what survives a full (generation 2) collection out
    of the next ones (docs/DESIGN.md, "The proxy").

    A full pass walks every tracked object while it holds the GIL, so every request waits for
    it, and the planner's record of what each conversation was sent grows with the
    conversations it holds: without this hook the pause grows with it. Frozen survivors are
    not walked; they are still freed when their last reference goes, but a reference cycle
    among them is not, so after every ``walk_all_every``-th full pass the survivors are
    unfrozen and the next full pass walks them all: such cycles wait at most that many passes.
    """

    def __init__(self, walk_all_every: int) -> None:
        if walk_all_every < 1:
            raise ValueError(f"walk_all_every must be at least 1, got {walk_all_every!r}")
        self.walk_all_every = walk_all_every
        self.full_passes = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        self.full_passes += 1
        if self.full_passes % self.walk_all_every == 0:
            gc.unfreeze()
        else:
            gc.freeze()


def apply_collection_policy(walk_all_every: int) -> FreezeSurvivors | None:
    """The garbage collector's policy for serving (docs/DESIGN.md, "The proxy"): what lives as
    long as the process (modules, the app) is collected once and frozen out of the collector's
    full passes, which stop every request; with ``walk_all_every`` (``--gc-walk-all-every``)
    at least 1, the survivors of each full pass are frozen too (:class:`FreezeSurvivors`,
    returned: its caller removes it from ``gc.callbacks`` when serving ends); 0 keeps Python's
    own full passes after start-up. Python's thresholds are kept."""
    gc.collect()
    gc.freeze()
    if walk_all_every == 0:
        return None
    hook = FreezeSurvivors(walk_all_every)
    gc.callbacks.append(hook)
    return hook


class ShutdownCutFilter(logging.Filter):
    """Tells uvicorn's record of an answer its shutdown cancelled in one line, no traceback.

    An answer still open when ``--shutdown-timeout`` has passed (a long stream) is cancelled
    by uvicorn, which logs the ``CancelledError`` that ends its request as an exception of
    the app; the cancellation did its work (the client's connection closed mid-answer, so
    its SDK sees an incomplete answer; the upstream call closed, so the engine stops), so the
    record becomes a one-line warning (docs/DESIGN.md, "The proxy").
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            record.msg = ("an answer still open past --shutdown-timeout was cut short by the "
                          "shutdown (its upstream call cancelled)")  # fmt: skip
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``contextpilot-server``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Before the app: making its service restores the snapshot, which may log.
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args, dict(os.environ))
        app = create_app(config)
    except ValueError as exc:
        parser.error(str(exc))
    if not config.tenancy.keyed and not args.no_auth and args.host not in _LOOPBACK_HOSTS:
        logger.warning(
            "no API key is set and --host %s is not a loopback address: anyone who reaches "
            "it may use the service%s; give keys (--api-keys), or pass --no-auth to say so",
            args.host,
            " and the proxy's upstream key" if config.proxy is not None else "",
        )
    logging.getLogger("uvicorn.error").addFilter(ShutdownCutFilter())
    hook = apply_collection_policy(args.gc_walk_all_every)
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            workers=1,
            log_level=args.log_level,
            access_log=args.access_log,
            timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)),
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            http=HeaderDeadlineProtocol,
        )
    finally:
        if hook is not None:
            gc.callbacks.remove(hook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
