"""The daemon: an aiohttp control plane over region, version and pull state, and the
data plane it supervises, in rooms by concern.

Rooms (each package's docstring lists its modules):

- `app/`: the shell: ``refitd serve``'s process, ``Daemon``, the HTTP edge, the API
  handlers, OpenAPI, long polls, metrics, systemd and cluster membership
- `access/`: who may talk to the daemon (tokens, principals), who owns and may read a
  model, per-principal caps, which peers may be contacted
- `state/`: regions, their memory and processes, versions, manifests, leases, staging
- `pull/`: a pull from its bounds check to its ending: the pure core and state machine,
  sources, paths, the byte loop, the peer client
- `mirror/`: host mirrors: chunks, the holder book, fill and swarm, the judge, digests,
  feeds, leases and space
- `delta/`: delta refit at the source: comparison, staging, the stream and routes
- `experts/`: MoE expert slot pools and their routes
"""
