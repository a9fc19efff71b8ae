"""The daemon: an aiohttp control plane over region, version and pull state, and the
data plane it supervises.

Modules:

- `process`: ``refitd serve``: one daemon process, its loop, listeners and ordered
  shutdown on SIGTERM/SIGINT
- `service`: the daemon as an operated service: config, access, metrics, API
- `handlers`: the API v1 handlers, and `create_app` that assembles them
- `openapi`: the OpenAPI 3.1 document, generated from the live router
- `httpio`: the HTTP edge handlers share: app keys, body decoding, replies
- `node`: `Daemon`: one daemon's life: identity, data planes, start/stop, peer records
- `store`: the region store: regions, their segments keyed by memory, pins, reaping
- `staging`: staging regions: source-side packing for a reader's lease
- `drain`: waiting for a version's leases to drain
- `plane`: the daemon's data planes as one set every region registers with
- `registry`: the pure state about sources: manifests, versions, leases
- `plancheck`: the bounds check every pull passes first
- `pullcore`: the pure core of a pull: validation, path choice, pacing, outcomes
- `pulls`: pulls: the awaits around the pull core (sources, data plane, progress)
- `pulljob`: one pull's record (progress, ending, what it holds while it runs)
- `pullstate`: a pull's life as a state machine: `step(state, event)`, pure
- `sources`: where a pull reads from: this daemon's regions or a peer's, by lease
- `move`: the one byte loop of a daemon
- `devstaging`: device destinations over a host-only data plane, staged through host memory
- `manifestcheck`: a published manifest checked against its tensors and regions
- `merging`: what a version's published slots make, as pure functions of its manifests
- `waits`: long polls: how long one may wait, how many one principal holds open
- `listeners`: what listens to a pull: the write rule, the pull cap
- `peerclient`: the daemon's client of its peer daemons (the calls a pull makes, and
  those a host mirror makes)
- `mirror`: one host mirror's chunks and the source's holder book (pure)
- `mirrors`: host mirrors and relay: policy, fill, relay, failover, release
- `mirrorhandlers`: the mirrors' routes, and `setup_mirrors` that installs their hooks
- `mirrorbook`: a source's holder book: who holds each version, and its deal of chunks
- `mirrorfill`: reading a host mirror's chunks from one holder (the source, or a relay)
- `mirrorswarm`: filling a host mirror from every holder at once, as the book deals it
- `mirrorjudge`: which holders a filling mirror leaves, as slow or late (pure)
- `mirrorfeed`: a mirror's feed: its complete chunks, pushed downstream as they land
- `mirrorread`: reading a mirror's chunks from a holder, and a holder's deadlines
- `mirrorhold`: which bytes of the mirrors still filling are complete, for the data plane
- `mirrorleases`: leases on a mirror's version: for peer daemons only, under the source's
- `mirrorspace`: the memory the mirrors take, and making room
- `mirrordigest`: chunk digests: the source's (computed once per version), a mirror's check
- `digestroutes`: the HTTP side of chunk digests at a version's source
- `deltas`: deltas at the source: each READY version compared with its base, staged
- `deltaroutes`: the HTTP side of delta refit: a version's delta record, its packs
- `deltastream`: a streamed delta, the source side: ``POST /v1/deltas/stream``
- `paths`: which data path reads each peer: the one place that decides
- `peers`: which peer daemons this daemon may contact
- `memory`: region memory: shared-memory segments
- `holders`: client processes regions live with, watched with pidfds
- `owners`: who owns a model and who may read it
- `trust`: the trust model: who may touch which bytes, checked once
- `auth`: who may talk to the daemon, and how much they may send
- `caps`: per-principal caps on leases, regions and pulls
- `pools`: MoE expert slot pools the daemon hosts
- `poolmemory`: where a pool's rows live: views into its two regions
- `poolapi`: the pools' HTTP API, ``/v1/experts``
- `membership`: the daemon's membership in the cluster registry: registering,
  announcing its versions, the ``/v1/cluster`` routes
- `metrics`: Prometheus metrics, ``GET /metrics``
- `sdnotify`: systemd's notify protocol
"""
