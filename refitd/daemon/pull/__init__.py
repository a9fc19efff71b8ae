"""A pull: its bounds check, its state machine and the awaits around it, where it reads
from and the one byte loop.

Modules:

- `connections`: a pull's path and connections: which data plane reads each source,
  the connection and credential it reads through
- `core`: the pure core of a pull: validation, path choice, pacing, outcomes
- `devstaging`: device destinations over a host-only data plane, staged through host
  memory
- `job`: one pull's record (progress, ending, what it holds while it runs)
- `listeners`: what listens to a pull: the write rule, the pull cap
- `machine`: a pull's life as a state machine: `step(state, event)`, pure
- `move`: the one byte loop of a daemon
- `paths`: which data path reads each peer: the one place that decides
- `peerclient`: the daemon's client of its peer daemons (the calls a pull makes, and
  those a host mirror makes)
- `plancheck`: the bounds check every pull passes first
- `pulls`: pulls: the awaits around the pull core (sources, data plane, progress)
- `sources`: where a pull reads from: this daemon's regions or a peer's, by lease
"""
