"""refitd's data plane: the transport interface (`transports.interface`), shared-memory
regions (`transports.segments`) and the ``reference``, ``local``, ``shm``, ``ucx`` and ``tcp`` transports.

Import what you use from its module; this package imports nothing heavy itself.
"""
