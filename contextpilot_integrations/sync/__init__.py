"""Where the engine's cache state comes from; every source ends in ``on_evict(rid)``.

- :mod:`~contextpilot_integrations.sync.kv_events`: the KV-event wire format of SGLang and
  vLLM (both shapes), decoding and encoding.
- :mod:`~contextpilot_integrations.sync.subscriber`: ``KVEventSubscriber``, the ZMQ
  subscriber with sequence tracking, replay repair, resync and restart detection.
- :mod:`~contextpilot_integrations.sync.cache_mirror`: ``CacheMirror``, the engine's cache
  rebuilt from the events, with attribution of blocks to request ids.
- :mod:`~contextpilot_integrations.sync.kv_event_source`: subscriber + mirror as one source.
- :mod:`~contextpilot_integrations.sync.capacity_model`: token budget + LRU, for engines that
  publish nothing.
- :mod:`~contextpilot_integrations.sync.ttl_model`: time-to-live, for hosted APIs (OpenAI,
  Anthropic prompt caching).
- :mod:`~contextpilot_integrations.sync.cache_state`: the common protocol
  (``CacheStateSource``, ``SentRequest``); :mod:`~contextpilot_integrations.sync.configuration`
  picks a source from a mapping.
- :mod:`~contextpilot_integrations.sync.event_publisher`: a publisher of the same protocol,
  for tests, benchmarks and simulators.

Nothing is imported here, so that the package imports without the ``sync`` extra (pyzmq,
msgspec) installed.
"""
