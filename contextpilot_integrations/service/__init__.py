"""The shared index as an HTTP service, and its client. One job per module:

- :mod:`.index_service`: ``IndexService``, the tenants' ``ContextPilot`` (one per tenant, or
  one shared) with one engine link, metrics, snapshot and boot id (usable without HTTP);
  :mod:`.service_config`: ``ServiceConfig``, its settings (also importable from
  :mod:`.index_service`);
- :mod:`.tenants`: API keys -> tenants, each tenant's rid tag and ``cache_salt``, the
  isolation modes; :mod:`.partitions`: each tenant's pilot and rid namespace;
- :mod:`.persistence`: the pilots' state in the snapshot file (checkpoints, the final save,
  restore);
- :mod:`.schemas`: the wire format, the core's request and plan types field for field;
- :mod:`.app`: ``create_app``, the FastAPI app; :mod:`.endpoints`: its handlers and routes;
  :mod:`.errors`: its error bodies; :mod:`.middleware`: request metering, the body limit and
  the boot id header;
- :mod:`.metrics`: the Prometheus registry; :mod:`.snapshot`: the snapshot file (checked
  on the way in, written atomically in small pieces);
- :mod:`.server`: ``contextpilot-server``, the command line;
- :mod:`.client`: ``ContextPilotClient``, the ``Planner`` contract over HTTP (sync and async
  twins); :mod:`.client_calls`: each call once, as a generator of HTTP requests;
  :mod:`.transports`: how they are sent (blocking, one transport per event loop);
  :mod:`.client_errors`: ``ServiceError``, ``ServiceUnavailableError`` and what each answer
  raises; :mod:`.client_fallback`: when to leave the service alone and the local plans
  instead; :mod:`.client_conversations`: what the client remembers per conversation (turn
  numbers across service restarts, calls that failed after they were sent).

Nothing is imported here, so that the package imports without the ``service`` extra.
"""
