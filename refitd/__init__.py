"""refitd: a per-node weight-transfer daemon for RL refit and MoE expert residency.

Packages and modules:

- `cli`: the ``refitd`` command line
- `config`: the daemon's configuration: one schema, loaded strictly, and the values
  it names (peer URLs, model tables, token files)
- `wire/`: the HTTP API v1 contract: request/response schemas, the error map, the
  route table
- `signing`: the one signing scheme: records MAC'd with the deployment secret
- `errors`: the exception tree, drawn once
- `memory_kinds`: the kinds of memory a region is made of (``host``, ``cuda``), one
  spelling for the wire and the transports
- `demo`: ``refitd demo``: the main job end to end, verified bit for bit
- `reshard/`: pure planning of resharded pulls: capture → plan → compile → execute
- `delta/`: delta refit, the pure part: what changed, where it lands, undoable writes
- `experts/`: pure MoE expert-slot residency: cache, policies, residency, executor
- `daemon/`: the daemon: aiohttp control plane, regions, versions, pulls, data plane
- `client/`: the Python client: RefitClient, Publisher, DaemonReceiver
- `cluster/`: the cluster registry (static, etcd): daemons and where versions live
- `integrations/`: trainer sources, quantized refit, the vLLM backend
- `ops/`: operator commands: status, regions, sources, pulls, experts, gc, pull
- `bench/`: ``refitd bench``: refit, transport, plan, experts, hosts, vllm
- `testing/`: test fixtures that ship: toy engines and trainer layouts
"""

__version__ = "0.1.0"
