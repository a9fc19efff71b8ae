"""The daemon's shell: its process, its ``Daemon``, the HTTP edge and the routes that are
not a room's own.

Modules:

- `handlers`: the API v1 handlers, and `create_app` that assembles them
- `httpio`: the HTTP edge handlers share: app keys, a route's parameters decoded into
  its args Struct before its handler runs, body decoding, replies
- `leasing`: what a lease reads on a daemon (its scope, the signed records a peer
  reads under it, packs), a lease's life and a version's drain: `Leases`, a part of
  `Daemon`
- `membership`: the daemon's membership in the cluster registry: registering, announcing
  its versions (a version listener), the ``/v1/cluster`` routes
- `metrics`: Prometheus metrics, ``GET /metrics``
- `node`: `Daemon`: one daemon's life: identity, data planes, start/stop, the rules a
  region's creation, deletion or publication passes
- `openapi`: the OpenAPI 3.1 document, generated from the live router
- `process`: ``refitd serve``: one daemon process, its loop, listeners and ordered
  shutdown on SIGTERM/SIGINT
- `refusals`: refusals as HTTP: the one ``{"error", "detail"}`` body, and the one 413
- `sdnotify`: systemd's notify protocol
- `service`: the daemon as an operated service: config, access, metrics, API
- `waits`: long polls: how long one may wait, how many one principal holds open
"""
