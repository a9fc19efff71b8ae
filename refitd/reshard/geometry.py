"""Geometry capture: which view of which source each destination parameter reads.

The engine's own ``load_weights`` runs once on a meta twin of the engine model,
fed zero-storage :class:`~refitd.reshard.lazy_weight.LazyWeight` placeholders instead of
source tensors. The placeholders record the movement ops the loaders apply and,
at each ``copy_``, where the result lands (offset, shape, stride in *elements* of
the destination). No byte moves. ``slice_plan`` later resolves each recorded chain
to elements of the full source and intersects it with the published shards.

Contracts:

* **Bulk first, per-source on refusal.** All weights go through one
  ``load_weights`` call (engines set up fused-expert maps once per call). If that
  pass raises :class:`UnsupportedReshard`, its records are discarded, the cause is
  logged at WARNING, and every weight is retried on its own so a refusal is
  attributed to the sources that caused it and to no other.
* **Attribution by memory.** A ``copy_`` (or a constant ``fill_``/``zero_``) is
  the write of the parameter or persistent buffer whose storage it lands in
  (:mod:`refitd.reshard.owners`), whichever code made it: a ``weight_loader``, or
  ``load_weights`` writing ``param.data`` itself (gpt-oss). A ``copy_`` into memory
  no parameter or buffer owns is counted in ``CaptureResult.unattributed``, said in
  ``unowned``, and not recorded. Each parameter's ``weight_loader`` (or
  ``default_weight_loader`` for parameters without one) is also wrapped for the
  capture, naming the parameter whose loader runs, which picks the owner among
  destinations that share one storage; the wrappers pass every argument through
  (loaders are often called by keyword) and are removed on every exit, including
  an unexpected exception, which propagates.
* **Fail closed.** Anything outside the allow-list marks its sources unsupported
  with the cause; a capture never records an approximate copy.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

import refitd.reshard.lazy_concat  # noqa: F401  (registers cat/stack support)
from refitd.reshard.lazy import CaptureRecorder, FillRecorder, LazyBase
from refitd.reshard.lazy_weight import LazyWeight
from refitd.reshard.owners import StorageOwners
from refitd.reshard.types import (
    CaptureResult,
    OpChain,
    OpSpec,
    RecordedCopy,
    UnsupportedReshard,
    summarize_unsupported,
)

__all__ = [
    "CaptureResult",
    "LazyWeight",
    "ManifestEntry",
    "OpChain",
    "OpSpec",
    "RecordedCopy",
    "UnsupportedReshard",
    "build_lazy_weights",
    "capture_geometry",
    "capture_weights",
    "convert_source_weights",
]

logger = logging.getLogger(__name__)

ManifestEntry = tuple[str, torch.dtype, Sequence[int]]
"""``(source name, dtype, global shape)`` of one full source tensor."""

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""Loader-facing weights: a mapping or ``(name, tensor)`` pairs, as ``load_weights`` takes."""


def build_lazy_weights(manifest: Iterable[ManifestEntry]) -> dict[str, LazyWeight]:
    """One placeholder per manifest entry, all sharing one capture recorder."""
    recorder = CaptureRecorder()
    return {
        name: LazyWeight(name, tuple(shape), dtype, "meta", recorder=recorder)
        for name, dtype, shape in manifest
    }


def convert_source_weights(
    convert: Callable[[dict[str, LazyWeight]], Weights] | None,
    manifest: Iterable[ManifestEntry],
) -> dict[str, LazyBase]:
    """Run a trainer→engine name/layout conversion on placeholders.

    ``convert`` receives ``{source name: placeholder}`` and returns the loader-facing
    weights (a mapping or pairs). ``None`` is the identity. A renamed placeholder
    keeps its source name; every placeholder derived from the manifest shares one
    recorder, as :func:`capture_weights` requires. Refused with
    :class:`UnsupportedReshard`: an output that is not derived from a source (a
    synthesized tensor), and any op outside the allow-list inside ``convert``
    (arithmetic, a cast to a non-floating dtype), which cannot be attributed to one
    source because the conversion runs as one call. A cast between floating dtypes
    is carried in the placeholder's cast chain, replayed at install.
    """
    lazies = build_lazy_weights(manifest)
    if convert is None:
        return dict(lazies)
    recorder = next(iter(lazies.values()))._recorder if lazies else None
    converted: dict[str, LazyBase] = {}
    for key, value in _pairs(convert(dict(lazies))):
        if not isinstance(value, LazyBase):
            raise UnsupportedReshard(
                f"conversion output {key!r} is a synthesized {type(value).__name__}, not "
                "derived from any source, so no pull can produce it"
            )
        if value._recorder is not recorder:
            raise UnsupportedReshard(
                f"conversion output {key!r} comes from placeholders of another capture"
            )
        converted[key] = value
    return converted


def capture_geometry(
    model: torch.nn.Module,
    manifest: Iterable[ManifestEntry],
    default_weight_loader: Callable[..., Any] | None = None,
) -> CaptureResult:
    """Capture ``model``'s loader geometry for every source in ``manifest``.

    ``model`` exposes ``load_weights(iterable of (name, tensor))`` and per-parameter
    ``weight_loader`` hooks, ideally on the meta device. Equivalent to
    ``capture_weights(model, build_lazy_weights(manifest), default_weight_loader)``.
    """
    return capture_weights(model, build_lazy_weights(manifest), default_weight_loader)


def capture_weights(
    model: torch.nn.Module,
    weights: Weights,
    default_weight_loader: Callable[..., Any] | None = None,
) -> CaptureResult:
    """Capture geometry for pre-built (possibly converted) placeholder ``weights``.

    Recorded copies name the placeholder's *source*, not the loader-facing key.
    Every weight must be a placeholder and all must share one recorder (build them
    with one :func:`build_lazy_weights` or :func:`convert_source_weights` call),
    else ``ValueError``. ``unsupported`` lists refused sources in the order met,
    ``unsupported_reasons`` the cause of each. Exceptions other than
    :class:`UnsupportedReshard` propagate after the loaders are restored.
    """
    items = _pairs(weights)
    recorder = _shared_recorder(items)
    result = CaptureResult()
    if recorder is None:
        return result
    first_copy, first_unattributed = len(recorder.copies), recorder.unattributed
    first_fill, first_unowned = len(recorder.fills), len(recorder.unowned)
    zeroed, owners = set(recorder.zeroed), recorder.owners
    saved = _install_stamps(model, recorder, default_weight_loader)
    recorder.owners = StorageOwners(model)
    fills = FillRecorder(recorder)
    try:
        try:
            with fills:
                model.load_weights(list(items))  # type: ignore[operator]
        except UnsupportedReshard as exc:
            # Bulk records may include writes of the refused weight and of weights
            # the loader reached before it; only the per-source pass is trusted.
            del recorder.copies[first_copy:]
            del recorder.fills[first_fill:]
            del recorder.unowned[first_unowned:]
            recorder.unattributed = first_unattributed
            recorder.zeroed = set(zeroed)
            recorder.current = None
            logger.warning(
                "reshard capture: bulk load_weights refused (%s); retrying %d weights one "
                "at a time",
                exc,
                len(items),
            )
            with fills:
                _capture_one_by_one(model, items, recorder, result)
    finally:
        _restore_stamps(saved)
        recorder.owners = owners
    result.copies = recorder.copies[first_copy:]
    result.fills = recorder.fills[first_fill:]
    result.unowned = recorder.unowned[first_unowned:]
    result.unattributed = recorder.unattributed - first_unattributed
    # Leave the recorder as found, so placeholders can serve another capture.
    del recorder.copies[first_copy:]
    del recorder.fills[first_fill:]
    del recorder.unowned[first_unowned:]
    recorder.unattributed = first_unattributed
    recorder.zeroed = zeroed
    _log_summary(result)
    return result


def _capture_one_by_one(
    model: torch.nn.Module,
    items: list[tuple[str, LazyBase]],
    recorder: CaptureRecorder,
    result: CaptureResult,
) -> None:
    for key, lazy in items:
        try:
            model.load_weights([(key, lazy)])  # type: ignore[operator]
        except UnsupportedReshard as exc:
            recorder.current = None
            for source in lazy.source_names():
                if source not in result.unsupported_reasons:
                    result.unsupported.append(source)
                    result.unsupported_reasons[source] = str(exc)


def _pairs(weights: Any) -> list[tuple[str, Any]]:
    if isinstance(weights, Mapping):
        return list(weights.items())
    return [(key, value) for key, value in weights]


def _shared_recorder(items: list[tuple[str, Any]]) -> CaptureRecorder | None:
    recorder: CaptureRecorder | None = None
    for key, value in items:
        if not isinstance(value, LazyBase):
            raise ValueError(
                f"weight {key!r} is a {type(value).__name__}, not a placeholder; build "
                "weights with build_lazy_weights or convert_source_weights"
            )
        if recorder is None:
            recorder = value._recorder
        elif value._recorder is not recorder:
            raise ValueError(
                f"weight {key!r} was built by another build_lazy_weights call: all "
                "weights of one capture must share one recorder"
            )
    return recorder


_LoaderSlot = tuple[torch.nn.Parameter, str, bool, Any]


def _install_stamps(
    model: torch.nn.Module,
    recorder: CaptureRecorder,
    default_weight_loader: Callable[..., Any] | None,
) -> list[_LoaderSlot]:
    """Wrap every parameter's loader so ``copy_`` can name the parameter.

    Returns ``(param, attribute, had_own_attribute, original)`` for restoration.
    Parameter classes exposing ``weight_loader`` as a read-only property (vLLM's
    v2 parameters) are stamped through their ``_weight_loader`` slot instead.
    """
    saved: list[_LoaderSlot] = []
    try:
        for name, param in model.named_parameters():
            original = getattr(param, "weight_loader", None)
            inner = original if original is not None else default_weight_loader
            if inner is None:
                continue
            stamped = _stamp(inner, name, recorder)
            for attribute in ("weight_loader", "_weight_loader"):
                had_own = attribute in vars(param)
                previous = vars(param).get(attribute)
                try:
                    setattr(param, attribute, stamped)
                except AttributeError:
                    continue
                saved.append((param, attribute, had_own, previous))
                break
    except BaseException:
        _restore_stamps(saved)
        raise
    return saved


def _stamp(inner: Callable[..., Any], name: str, recorder: CaptureRecorder) -> Callable[..., Any]:
    @functools.wraps(inner)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        # Pass-through of every argument: engines call loaders positionally and by
        # keyword (fused-MoE loaders take param=, loaded_weight=, expert_id=...).
        previous = recorder.current
        recorder.current = name
        try:
            return inner(*args, **kwargs)
        finally:
            recorder.current = previous

    return stamped


def _restore_stamps(saved: list[_LoaderSlot]) -> None:
    for param, attribute, had_own, previous in reversed(saved):
        if had_own:
            setattr(param, attribute, previous)
        else:
            vars(param).pop(attribute, None)


def _log_summary(result: CaptureResult) -> None:
    logger.info(
        "reshard capture: %d copies, %d unsupported source(s), %d unattributed copy_",
        len(result.copies),
        len(result.unsupported),
        result.unattributed,
    )
    # One cause often knocks out a whole family of sources (every expert of a
    # layer type); the grouped causes say why, the names alone would not.
    for cause, count in summarize_unsupported(result.unsupported_reasons):
        logger.warning("reshard capture: %d source(s) unsupported, cause: %s", count, cause)
