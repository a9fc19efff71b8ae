"""refitd's data plane: one interface, one batch algebra, one module per transport.

Import what you use from its module; this package imports nothing heavy itself.

Modules:

- `interface`: `Transport`, `Peer`, `PeerInfo`, the errors, the scheme registry
- `batch`: the batch algebra: ``READ_DTYPE`` rows, validation, coalescing, splits
- `segments`: shared-memory segments under /dev/shm, owner-controlled lifetime
- `reference`: the ``reference`` transport: one memmove per read (the oracle)
- `local`: the ``local`` transport: a parallel memcpy in this process
- `inproc`: machinery shared by the two same-process transports
- `shm`: the ``shm`` transport: a same-host peer's segments, mapped here
- `tcp/`: the ``tcp`` transport: refitd's own lanes of plain TCP
- `ucx/`: the ``ucx`` transport: UCX GETs from supervised child processes
- `native/`: the C helpers: batched memcpy, UCX RMA calls
- `checks`: the contract checks every transport passes
- `servepeer`: a peer in its own process, for tests
"""
