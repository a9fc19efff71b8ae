"""Host residency of each layer's expert rows, and which copies it permits.

Where a layer's host rows live decides how they can reach the slot pool:

- ``PINNED`` rows are registered with the device, so each row has a device-visible
  address and any row can be copied into any slot (the indexed route an eviction
  policy needs);
- ``LOCKED`` rows are page-locked (never swapped) but not registered, and
  ``PAGEABLE`` rows are ordinary memory: neither has a device address, so the only
  copy is a synchronous staged one of the whole layer, into slot ``e`` for expert ``e``.

An unpinned layer cannot serve a per-slot remap, so its routed experts must be
computed on the CPU; ``BankResidency`` refuses a configuration that says otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from refitd.errors import ConfigError, PlanError

__all__ = [
    "BankResidency",
    "CopyRoute",
    "HostResidency",
    "InconsistentResidency",
    "ResidencyError",
    "SlotRemapOnUnpinnedLayer",
]


class HostResidency(enum.Enum):
    """How one layer's host expert rows are allocated."""

    PINNED = "pinned"
    LOCKED = "locked"
    PAGEABLE = "pageable"


class CopyRoute(enum.Enum):
    """How a plan's copies must be carried out, as ``SlotDevice.begin_plan`` is told."""

    INDEXED = "indexed"
    """Per-slot async copies from device-visible (pinned) rows."""

    WHOLE_LAYER_PINNED = "whole_layer_pinned"
    """The whole layer from pinned rows; may be captured into a graph."""

    WHOLE_LAYER_PAGEABLE = "whole_layer_pageable"
    """The whole layer from rows with no device address: a synchronous staged copy,
    which a backend that captures work into a graph must not capture."""


class ResidencyError(PlanError):
    """A residency configuration or a copy it cannot serve."""


class InconsistentResidency(ResidencyError, ConfigError):
    """The per-layer residency settings contradict each other."""


class SlotRemapOnUnpinnedLayer(ResidencyError):
    """A per-slot copy was asked of a layer whose host rows have no device address."""

    def __init__(self, layer: int, residency: HostResidency) -> None:
        self.layer = layer
        self.residency = residency
        super().__init__(
            f"layer {layer} has {residency.value} host rows, which the device cannot "
            "address, so a per-slot remap would read from no valid source; only a "
            "whole-layer copy can serve it"
        )


@dataclass(frozen=True)
class BankResidency:
    """Per-layer host residency plus the layers whose experts run on the CPU.

    Build with ``BankResidency.build`` (checks the layer count) or
    ``BankResidency.all_pinned``. Refused at construction: no layers; a CPU layer
    index outside the layers; an unpinned layer that is not a CPU layer (nothing
    could compute its routed experts from slots it cannot remap into).
    """

    layers: tuple[HostResidency, ...]
    cpu_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.layers:
            raise InconsistentResidency("a residency map needs at least one layer")
        n = len(self.layers)
        outside = sorted(layer for layer in self.cpu_layers if not 0 <= layer < n)
        if outside:
            raise InconsistentResidency(
                f"CPU layers {outside} are outside the {n} layers the residency map covers"
            )
        stranded = [
            layer
            for layer, r in enumerate(self.layers)
            if r is not HostResidency.PINNED and layer not in self.cpu_layers
        ]
        if stranded:
            raise InconsistentResidency(
                f"layers {stranded} are not pinned yet not CPU layers: their rows cannot "
                "be remapped into slots, so nothing could compute their routed experts"
            )

    @classmethod
    def all_pinned(cls, num_layers: int) -> BankResidency:
        return cls.build([HostResidency.PINNED] * num_layers, num_layers)

    @classmethod
    def build(
        cls,
        residency: Sequence[HostResidency],
        num_layers: int,
        cpu_layers: Iterable[int] = (),
    ) -> BankResidency:
        """Check that ``residency`` covers exactly ``num_layers`` layers, then build."""
        if len(residency) != num_layers:
            raise InconsistentResidency(
                f"residency lists {len(residency)} layers but the model has {num_layers}"
            )
        return cls(tuple(residency), frozenset(cpu_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def of(self, layer: int) -> HostResidency:
        self._check(layer)
        return self.layers[layer]

    def is_cpu_layer(self, layer: int) -> bool:
        self._check(layer)
        return layer in self.cpu_layers

    def copy_route(self, layer: int, whole_layer: bool) -> CopyRoute:
        """The route a copy into ``layer``'s slots takes, or why there is none.

        A pinned layer takes either shape; an unpinned one only the whole layer.
        """
        r = self.of(layer)
        if r is HostResidency.PINNED:
            return CopyRoute.WHOLE_LAYER_PINNED if whole_layer else CopyRoute.INDEXED
        if whole_layer:
            return CopyRoute.WHOLE_LAYER_PAGEABLE
        raise SlotRemapOnUnpinnedLayer(layer, r)

    def _check(self, layer: int) -> None:
        if not 0 <= layer < len(self.layers):
            raise ResidencyError(
                f"layer {layer} is outside the residency map's 0..{len(self.layers) - 1}"
            )
