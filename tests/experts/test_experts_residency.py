"""Host residency: which copies each layer's host rows permit."""

from __future__ import annotations

import pytest

from refitd.errors import ConfigError
from refitd.experts import (
    BankResidency,
    CopyRoute,
    HostResidency,
    InconsistentResidency,
    ResidencyError,
    SlotRemapOnUnpinnedLayer,
)

P, L, G = HostResidency.PINNED, HostResidency.LOCKED, HostResidency.PAGEABLE


def test_a_pinned_layer_takes_a_slot_remap_and_a_whole_layer_copy() -> None:
    r = BankResidency.all_pinned(2)
    assert r.copy_route(0, whole_layer=False) is CopyRoute.INDEXED
    assert r.copy_route(1, whole_layer=True) is CopyRoute.WHOLE_LAYER_PINNED


@pytest.mark.parametrize("kind", [L, G])
def test_an_unpinned_layer_takes_only_a_synchronous_whole_layer_copy(
    kind: HostResidency,
) -> None:
    r = BankResidency.build([P, kind], 2, cpu_layers=[1])
    assert r.copy_route(1, whole_layer=True) is CopyRoute.WHOLE_LAYER_PAGEABLE
    with pytest.raises(SlotRemapOnUnpinnedLayer) as info:
        r.copy_route(1, whole_layer=False)
    assert info.value.layer == 1 and info.value.residency is kind
    assert kind.value in str(info.value)


def test_an_unpinned_layer_that_is_not_a_cpu_layer_is_refused() -> None:
    with pytest.raises(InconsistentResidency, match=r"layers \[1\] are not pinned"):
        BankResidency.build([P, G, P], 3)


def test_a_cpu_layer_outside_the_model_is_refused() -> None:
    with pytest.raises(InconsistentResidency, match=r"CPU layers \[5\]"):
        BankResidency.build([P, P], 2, cpu_layers=[5])


def test_a_residency_list_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(InconsistentResidency, match="lists 2 layers but the model has 3"):
        BankResidency.build([P, P], 3)
    with pytest.raises(InconsistentResidency):
        BankResidency.build([], 0)


def test_residency_refusals_are_configuration_errors() -> None:
    assert issubclass(InconsistentResidency, ConfigError)
    with pytest.raises(ResidencyError, match="outside"):
        BankResidency.all_pinned(2).copy_route(2, whole_layer=True)


def test_a_pinned_cpu_layer_is_allowed() -> None:
    r = BankResidency.build([P, P], 2, cpu_layers=[0])
    assert r.is_cpu_layer(0) and not r.is_cpu_layer(1)
    assert r.of(1) is P
