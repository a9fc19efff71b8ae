"""Host mirrors: one copy of a version per host, filled from every holder, read by its
engines and by the hosts below it.

Modules:

- `book`: a source's holder book: who holds each version, and its deal of chunks
- `chunks`: one host mirror's chunks and the source's holder book (pure)
- `digest`: chunk digests: the source's (computed once per version), a mirror's check
- `digestroutes`: the HTTP side of chunk digests at a version's source
- `feed`: a mirror's feed: its complete chunks, pushed downstream as they land
- `fill`: reading a host mirror's chunks from one holder (the source, or a relay)
- `hold`: which bytes of the mirrors still filling are complete, for the data plane and
  the records
- `judge`: which holders a filling mirror leaves, as slow or late (pure)
- `leases`: leases on a mirror's version: for peer daemons only, under the source's
- `mirrors`: host mirrors and relay: policy, fill, relay, failover, release
- `read`: reading a mirror's chunks from a holder, and a holder's deadlines
- `routes`: the mirrors' routes, and `setup_mirrors` that builds and installs their store
- `space`: the memory the mirrors take, and making room
- `swarm`: filling a host mirror from every holder at once, as the book deals it
"""
