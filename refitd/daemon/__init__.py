"""The daemon: an aiohttp control plane over region, version and pull state, and the
data plane it supervises.

Modules:

- `serve`: ``refitd serve``: run one daemon until SIGTERM/SIGINT
- `service`: the daemon as an operated service: config, access, metrics, API
- `app`: the aiohttp application of API v1
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
- `cluster`: the daemon's side of the cluster registry
- `metrics`: Prometheus metrics, ``GET /metrics``
- `sdnotify`: systemd's notify protocol
"""
