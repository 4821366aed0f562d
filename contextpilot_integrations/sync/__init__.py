"""Where the engine's cache state comes from; every source ends in ``on_evict(rid)``.

- :mod:`~contextpilot_integrations.sync.engine_link`: ``EngineLink``, the link the pilot, the
  router, the service and the benchmark use (it implements the core's
  ``EngineLinkProtocol``): a source built from a configuration mapping
  (:mod:`~contextpilot_integrations.sync.configuration`, ``CacheSyncConfig``), what was sent,
  evictions, resync after a restore, failures absorbed. The common source protocol:
  :mod:`~contextpilot_integrations.sync.cache_state_source`.
- The engine's own KV-cache events (SGLang, vLLM): ``KVEventSource``
  (:mod:`~contextpilot_integrations.sync.kv_event_source`) joins the subscriber
  (:mod:`~contextpilot_integrations.sync.subscriber`; one rank's sequence:
  :mod:`~contextpilot_integrations.sync.rank_stream`; the replay socket:
  :mod:`~contextpilot_integrations.sync.replay_client`; the wire format:
  :mod:`~contextpilot_integrations.sync.kv_events`) and the mirror
  (:mod:`~contextpilot_integrations.sync.cache_mirror`, over
  :mod:`~contextpilot_integrations.sync.block_mirror` with its tree, namespaces and page keys,
  and :mod:`~contextpilot_integrations.sync.request_attribution`).
  :mod:`~contextpilot_integrations.sync.event_publisher` publishes the same protocol, for
  tests, benchmarks and simulators.
- :mod:`~contextpilot_integrations.sync.capacity_model`: token budget + LRU, for engines that
  publish nothing; :mod:`~contextpilot_integrations.sync.ttl_model`: time-to-live, for hosted
  APIs.

Nothing is imported here, so that the package imports without the ``sync`` extra (pyzmq,
msgspec) installed.
"""
