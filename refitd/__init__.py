"""refitd: a per-node weight-transfer daemon for RL refit and MoE expert residency.

Packages:
    refitd.reshard   pure planning of resharded pulls (capture → plan → compile)
    refitd.experts   pure MoE expert-slot residency (cache, residency, executor)
    refitd.daemon    the aiohttp control plane and data-plane supervision
    refitd.client    the async/sync Python client, Publisher and receiver glue
    transports       the data-plane interface and its implementations
"""

__version__ = "0.1.0"
