"""Swap mode's inactive copy held for later: prefetch a version while the engine
serves, swap it in at a moment of the caller's choosing (in-flight refit, docs/vllm.md).

:class:`Prefetch` is mixed into :class:`~refitd.client.receiver.DaemonReceiver`:
:meth:`~Prefetch.prefetch` runs a swap-mode refit's lease, plan, pull into the
inactive copy and the landing of every byte there, and stops before the swap;
:meth:`~Prefetch.swap_prefetched` rebinds the parameters to that copy (no byte
copied). Nothing the engine reads is written in between, and any other refit of the
receiver replaces what was prefetched (it writes the same inactive copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from refitd.errors import ConflictError
from refitd.wire import PullProgress

if TYPE_CHECKING:
    from refitd.client.engine import EngineMemory
    from refitd.client.install import CompiledPull, RefitStats

__all__ = ["Prefetch"]


class Prefetch:
    """The prefetch half of a swap-mode receiver (module docstring); the receiver sets
    the attributes below."""

    model: str
    mode: str
    #: the compiled pull whose bytes wait whole in the inactive copy, and its version
    prefetched: tuple[int, CompiledPull] | None
    _hold: bool  # the refit running stops before its swap (prefetch())
    memory: EngineMemory

    async def refit(
        self,
        version: int | None = None,
        *,
        on_progress: Callable[[PullProgress], None] | None = None,
    ) -> RefitStats:
        raise NotImplementedError

    def _swap(self, comp: CompiledPull) -> None:
        raise NotImplementedError

    async def _full_leased(self, *args: Any) -> RefitStats:
        raise NotImplementedError

    async def prefetch(
        self,
        version: int | None = None,
        *,
        on_progress: Callable[[PullProgress], None] | None = None,
    ) -> RefitStats:
        """Swap mode, host memory: pull ``version`` (in full, whatever refit kind
        this receiver runs) into the inactive copy and land all of it there, writing
        nothing the engine reads; :attr:`prefetched` then names it until
        :meth:`swap_prefetched` swaps it in, or any other refit replaces it. A failure
        leaves nothing prefetched and the engine as it was."""
        if self.mode != "swap":
            raise ConflictError(
                f"prefetch of {self.model!r} refused: it needs swap mode on host memory "
                f"(this receiver runs {self.mode!r}); refit instead"
            )
        self._hold = True
        try:
            return await self.refit(version, on_progress=on_progress)
        except BaseException:
            self.prefetched = None
            raise
        finally:
            self._hold = False

    def swap_prefetched(self, version: int) -> None:
        """Rebind the parameters to the inactive copy, which holds ``version`` whole
        (:meth:`prefetch`); no byte is copied. Refused, changing nothing, when it does not."""
        held = None if self.prefetched is None else self.prefetched[0]
        if held != version:
            raise ConflictError(
                f"swap of {self.model!r} to v{version} refused: the inactive copy holds "
                f"{'nothing prefetched' if held is None else f'v{held}'}"
            )
        assert self.prefetched is not None
        comp = self.prefetched[1]
        self.prefetched = None
        self._swap(comp)

    def inactive(self) -> dict[str, torch.Tensor]:
        """Swap mode: each parameter's view into the copy it does not read now (after
        :meth:`prefetch`, the prefetched version's bytes)."""
        views = self.memory.views
        assert views is not None, "prefetch() first: the engine is not placed in swap mode"
        return views.views[1 - self.memory.serving]

    def pulled_into(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory refits write (the engine's segments)."""
        at = t.data_ptr()
        for area in (self.memory.engine, self.memory.shadow, self.memory.scratch):
            if area is not None and area.seg is not None:
                base = area.seg.numpy().ctypes.data
                if base <= at < base + area.seg.size:
                    return True
        return False
