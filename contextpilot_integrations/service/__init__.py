"""The shared index as an HTTP service, and its client. One job per module:

- :mod:`.index_service`: ``IndexService``, the tenants' ``ContextPilot`` (one per tenant, or
  one shared) with one engine link, metrics and snapshot (usable without HTTP);
- :mod:`.tenants`: API keys -> tenants, each tenant's rid tag and ``cache_salt``, the
  isolation modes; :mod:`.partitions`: each tenant's pilot and rid namespace;
- :mod:`.persistence`: the pilots' state in the snapshot file (checkpoints, the final save,
  restore);
- :mod:`.schemas`: the wire format, the core's request and plan types field for field;
- :mod:`.app`: ``create_app``, the FastAPI app; :mod:`.endpoints`: its handlers and routes;
  :mod:`.errors`: its error bodies; :mod:`.middleware`: request metering and the body limit;
- :mod:`.metrics`: the Prometheus registry; :mod:`.snapshot`: the snapshot file (checked
  on the way in, written atomically in small pieces);
- :mod:`.server`: ``contextpilot-server``, the command line;
- :mod:`.client`: ``ContextPilotClient``, the ``Planner`` contract over HTTP (sync and async
  twins, local fallback); :mod:`.transports`: how it sends (blocking, one transport per
  event loop).

Nothing is imported here, so that the package imports without the ``service`` extra.
"""
