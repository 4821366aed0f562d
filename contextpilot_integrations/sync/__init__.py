"""Where the engine's cache state comes from; every source ends in ``on_evict(rid)``.

- :mod:`~contextpilot_integrations.sync.engine_link`: ``EngineLink``, the one link the
  in-process pilot, the service and the benchmark use: a source built from a configuration
  mapping, what was sent, evictions, resync after a restore, failures absorbed.
- :mod:`~contextpilot_integrations.sync.configuration`: ``CacheSyncConfig`` (the mapping,
  validated) and ``build_cache_state_source``.
- :mod:`~contextpilot_integrations.sync.cache_state_source`: the common protocol
  (``CacheStateSource``, ``SentRequest``).
- The engine's own KV-cache events (SGLang, vLLM):

  - :mod:`~contextpilot_integrations.sync.kv_event_source`: ``KVEventSource``, subscriber +
    mirror as one source;
  - :mod:`~contextpilot_integrations.sync.kv_events`: the wire format (both shapes), decoding
    (bounded in size and depth; a bad event is skipped, its batch-mates kept) and encoding;
  - :mod:`~contextpilot_integrations.sync.subscriber`: ``KVEventSubscriber``, the thread and
    the ZMQ sockets;
  - :mod:`~contextpilot_integrations.sync.rank_stream`: ``RankStream``, one rank's sequence
    numbers kept continuous (gap repair, restart detection, resync, idle probes);
  - :mod:`~contextpilot_integrations.sync.replay_client`: ``ReplayClient``, the client of the
    engine's replay socket;
  - :mod:`~contextpilot_integrations.sync.cache_mirror`: ``CacheMirror``, the entry point that
    applies events and reports evicted requests, joining
  - :mod:`~contextpilot_integrations.sync.block_mirror`: ``BlockMirror``, the blocks each rank
    holds (its tree: :mod:`~contextpilot_integrations.sync.block_tree`; tenant and adapter
    namespaces: :mod:`~contextpilot_integrations.sync.block_namespaces`; page keys:
    :mod:`~contextpilot_integrations.sync.page_tokens`), and
  - :mod:`~contextpilot_integrations.sync.request_attribution`: ``RequestAttribution``, blocks
    attributed to request ids (echoed session id, token matching) and the eviction rule;
  - :mod:`~contextpilot_integrations.sync.event_publisher`: ``KVEventPublisher``, a publisher
    of the same protocol, for tests, benchmarks and simulators.

- :mod:`~contextpilot_integrations.sync.capacity_model`: token budget + LRU, for engines that
  publish nothing.
- :mod:`~contextpilot_integrations.sync.ttl_model`: time-to-live, for hosted APIs (OpenAI,
  Anthropic prompt caching).

Nothing is imported here, so that the package imports without the ``sync`` extra (pyzmq,
msgspec) installed.
"""
