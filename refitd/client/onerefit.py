"""One refit at a time on one engine (:class:`OneRefit`), as
:class:`~refitd.client.receiver.DaemonReceiver` runs them.

A refit writes its engine's destinations: the parameters, the staging scratch, or in
swap mode the second segment (:mod:`refitd.client.swap`). Two at once on one engine
would write the same destinations, and the engine would end on neither version
whole while both reported success; so a second refit, asked while one runs, is
refused (409) before it does anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from refitd.errors import ConflictError

__all__ = ["OneRefit"]


class OneRefit:
    """One refit at a time on one engine: a second, started while the first runs, is
    refused (409) before it does anything. Two at once would write the same
    destinations (in swap mode the same second segment), and the engine would end on
    neither version whole, while both reported success."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.running = ""  # the version the running refit asked for, "" when none

    @contextlib.contextmanager
    def refit(self, version: int | None) -> Iterator[None]:
        asked = "its newest version" if version is None else f"version {version}"
        if self.running:
            raise ConflictError(
                f"refit of {self.model!r} to {asked} refused: a refit to {self.running} "
                "still runs on this engine; refit one version at a time"
            )
        self.running = asked
        try:
            yield
        finally:
            self.running = ""
