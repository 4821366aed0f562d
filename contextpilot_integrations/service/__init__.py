"""The shared index as an HTTP service (``contextpilot-server``). One job per module:

- :mod:`.index_service`: ``IndexService``, the tenants' ``ContextPilot`` (one per tenant, or
  one shared) with one engine link, metrics, snapshot and boot id (usable without HTTP);
  :mod:`.service_config`: ``ServiceConfig``, its settings;
- :mod:`.tenants`: API keys -> tenants, each tenant's rid tag and ``cache_salt``, the
  isolation modes; :mod:`.partitions`: each tenant's pilot and rid namespace;
- :mod:`.persistence`: the pilots' state in the snapshot file (checkpoints, the final save,
  restore); :mod:`.snapshot`: the snapshot file (checked on the way in, written atomically in
  small pieces);
- :mod:`.app`: ``create_app``, the FastAPI app; :mod:`.endpoints`: its handlers and routes;
  :mod:`.errors`: its error bodies; :mod:`.middleware`: request metering, the body limit and
  the boot id header; :mod:`.metrics`: the Prometheus registry;
- :mod:`.server`: ``contextpilot-server``, the command line;
- :mod:`.proxy`: the proxy mode (``--upstream URL``), OpenAI's and Anthropic's chat endpoints
  planned and forwarded.

The wire format and the client are :mod:`contextpilot_integrations.client`. Nothing is
imported here, so that the package imports without the ``service`` extra.
"""
