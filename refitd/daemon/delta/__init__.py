"""Delta refit at the source: each version compared with its base, and the routes that
serve it.

Modules:

- `plans`: the plans a source keeps for its delta readers (a warm refit names its plan)
- `routes`: the HTTP side of delta refit: a version's delta record, its packs
- `source`: deltas at the source: each READY version compared with its base, its record
- `selection`: a planned pull's delta: selected from the records, checked, staged
- `stream`: a streamed delta, the source side: ``POST /v1/deltas/stream``
"""
