"""refitd's data plane: one interface, one batch algebra, one module per transport.

Import what you use from its module; this package imports nothing heavy itself.

Modules:

- `interface`: `Transport`, `Peer`, `PeerInfo`, the errors, the scheme registry
- `batch`: the batch algebra: ``READ_DTYPE`` rows, validation, coalescing, splits
- `segments`: shared-memory segments under /dev/shm, owner-controlled lifetime
- `memory`: what a region is made of: a memory kind, its identity, owner proof, copies
- `cuda`: the ``cuda`` memory kind: a GPU allocation opened from its IPC handle
- `cudaexport`: the client side of it: a GPU allocation exported for a daemon
- `cudadriver`: the CUDA driver API through ctypes
- `cudacopies`: a GPU batch's copies planned without a GPU
- `devcopy`: what every device's copy engine does around its driver's copies
- `pins`: host memory page-locked for device copies, one table per process
- `reference`: the ``reference`` transport: one memmove per read (the oracle)
- `local`: the ``local`` transport: a parallel memcpy in this process
- `inproc`: machinery shared by the two same-process transports
- `shm`: the ``shm`` transport: a same-host peer's segments, mapped here
- `shmkeys`: what a same-host record names (a segment's file, the boot id), and
  a lease's grant of it checked at the reader
- `tcp/`: the ``tcp`` transport: refitd's own lanes of plain TCP
- `ucx/`: the ``ucx`` transport: UCX GETs from supervised child processes
- `native/`: the C helpers: batched memcpy, UCX RMA calls
- `checks`: the contract checks every transport passes
- `servepeer`: a peer in its own process, for tests
"""
