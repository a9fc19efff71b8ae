"""Who may talk to the daemon, what each principal may see and touch, and how much it may
hold.

Modules:

- `auth`: who may talk to the daemon, and how much they may send
- `caps`: per-principal caps on leases, regions and pulls
- `owners`: who owns a model and who may read it
- `peers`: which peer daemons this daemon may contact
- `trust`: the trust model: who may touch which bytes, checked once
"""
