"""MoE expert slot pools the daemon hosts, and ``/v1/experts``.

Modules:

- `memory`: where a pool's rows live: views into its two regions
- `pools`: MoE expert slot pools the daemon hosts
- `routes`: the pools' HTTP API, ``/v1/experts``
"""
