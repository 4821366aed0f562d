"""The shared index as an HTTP service, and its client. One job per module:

- :mod:`.index_service`: ``IndexService``, one ``ContextPilot`` with its engine link, metrics
  and snapshot (usable without HTTP);
- :mod:`.schemas`: the wire format, the core's request and plan types field for field;
- :mod:`.app`: ``create_app``, the FastAPI app; :mod:`.endpoints`: its handlers and routes;
  :mod:`.errors`: its error bodies; :mod:`.middleware`: request metering and the body limit;
- :mod:`.metrics`: the Prometheus registry; :mod:`.snapshot`: the snapshot file;
- :mod:`.server`: ``contextpilot-server``, the command line;
- :mod:`.client`: ``ContextPilotClient``, the ``Planner`` contract over HTTP (sync and async
  twins, local fallback); :mod:`.transports`: how it sends (blocking, one transport per
  event loop).

Nothing is imported here, so that the package imports without the ``service`` extra.
"""
