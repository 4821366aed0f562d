"""The proxy mode of the index service (``contextpilot-server --upstream URL``): OpenAI's
``POST /v1/chat/completions`` and Anthropic's ``POST /v1/messages`` planned with the agent
rules and forwarded to an upstream engine or hosted API; every other ``/v1/`` path passed
through unchanged (docs/DESIGN.md, "The proxy"). One job per module:

- :mod:`.proxy_config`: ``ProxyConfig``, the upstream, its credentials and kind;
- :mod:`.conversation_key`: which conversation a request belongs to;
- :mod:`.request_planning`: each tenant's message planner, the body as sent (planned messages,
  engine fields, cache controls) and what the plan changed;
- :mod:`.document_placement`: documents marked in the body, planned by the tenant's context
  index and put in front of the newest user message; the messages sent with them put back on
  later calls;
- :mod:`.upstream`: the pooled HTTP client to the upstream, URLs and headers;
- :mod:`.connection_gate`: the pool's connections shared fairly between tenants, with a
  bounded wait;
- :mod:`.usage_watch`: usage read from an answer's bytes as they pass (JSON or SSE);
- :mod:`.forwarding`: the answer streamed to the client as it arrives, cancelled when the
  client goes;
- :mod:`.api_errors`: error bodies in the OpenAI and Anthropic shapes;
- :mod:`.peer_config`: ``PeerConfig``, the proxy processes that plan as one;
- :mod:`.peers`: each call's owner among them and the hop to it;
- :mod:`.routes`: the endpoints.

Nothing is imported here, so that the package imports without the ``service`` extra.
"""
