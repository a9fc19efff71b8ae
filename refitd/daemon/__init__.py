"""The daemon: an aiohttp control plane over region, version and pull state, and the
data plane it supervises.

Modules:

- `process`: ``refitd serve``: one daemon process, its loop, listeners and ordered
  shutdown on SIGTERM/SIGINT
- `service`: the daemon as an operated service: config, access, metrics, API
- `handlers`: the API v1 handlers, and `create_app` that assembles them
- `openapi`: the OpenAPI 3.1 document, generated from the live router
- `httpio`: the HTTP edge handlers share: app keys, body decoding, replies
- `node`: `Daemon`: one daemon's live state, regions, registry, data plane
- `registry`: the pure state about sources: manifests, versions, leases
- `regions`: region records and the bounds check every pull passes first
- `pulls`: pulls: validate a whole plan, then move its bytes
- `paths`: which data path reads each peer: the one place that decides
- `peers`: which peer daemons this daemon may contact
- `copier`: moving bytes between mapped regions of one host
- `memory`: region memory: shared-memory segments
- `holders`: client processes regions live with, watched with pidfds
- `owners`: who owns a model and who may read it
- `trust`: the trust model: who may touch which bytes, checked once
- `auth`: who may talk to the daemon, and how much they may send
- `caps`: per-principal caps on leases, regions and pulls
- `experts`: MoE expert slot pools the daemon hosts: ``/v1/experts``
- `membership`: the daemon's membership in the cluster registry: registering,
  announcing its versions, the ``/v1/cluster`` routes
- `metrics`: Prometheus metrics, ``GET /metrics``
- `sdnotify`: systemd's notify protocol
"""
