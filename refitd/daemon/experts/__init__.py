"""MoE expert slot pools the daemon hosts, and ``/v1/experts``.

Modules:

- `memory`: where a pool's rows live: views into its two regions
- `pool`: one hosted pool: planner and executor over its regions, and its operations
- `pools`: the daemon's pools: made, admitted, deleted, and the pulls that rewrite them
- `routes`: the pools' HTTP API, ``/v1/experts``
"""
