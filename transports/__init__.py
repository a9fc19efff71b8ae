"""refitd's data plane: the transport interface (`transports.core`), shared-memory
regions (`transports.shm`) and the ``reference``, ``local``, ``shm``, ``ucx`` and ``tcp`` transports.

Import what you use from its module; this package imports nothing heavy itself.
"""
