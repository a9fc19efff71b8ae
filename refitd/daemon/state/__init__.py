"""What the daemon holds: regions and their memory, versions, leases, staging.

Modules:

- `drain`: waiting for a version's leases to drain
- `events`: what listens to a daemon's versions: a part published, a drain, a retire
- `processes`: client processes regions live with, watched with pidfds
- `manifestcheck`: a published manifest checked against its tensors and regions
- `memory`: region memory: shared-memory segments
- `merging`: what a version's published parts make, as pure functions of its manifests
- `plane`: the daemon's data planes as one set every region registers with
- `records`: region records by id
- `registry`: the pure state about sources: manifests, versions, leases
- `staging`: staging regions: source-side packing for a reader's lease
- `store`: the region store: regions, their segments keyed by memory, pins, reaping
- `versions`: version and lease records, and reading a version: regions, scope, merged manifest
"""
