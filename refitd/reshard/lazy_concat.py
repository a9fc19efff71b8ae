"""``torch.cat`` / ``torch.stack`` of placeholders, decomposed into per-piece copies.

A :class:`LazyConcat` is the concatenation of placeholders along one dimension
(a stack is a concatenation of ``unsqueeze``-d pieces). When it reaches a
``copy_`` sink it records one :class:`~refitd.reshard.types.RecordedCopy` per
piece, each into the slice of the destination that piece occupies, with the
piece's own source and chain.

Movement ops applied to a concatenation are pushed into the pieces: an op that
leaves the concatenated dimension whole is applied to every piece; ``narrow``,
``select``, step slices, ``chunk``/``split``/``unbind`` along it pick the pieces
they touch; ``view``/``reshape``/``flatten``/``unflatten`` are accepted when every
piece stays a contiguous block of the new outer dimension. Anything else is
refused. Each resolution is checked against the shape eager torch reports, so a
resolution can be refused but never recorded wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from refitd.reshard.lazy import LazyBase

__all__ = ["LazyConcat", "make_concat"]

_SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[Any, ...]]] = {
    # name -> (parameter names, defaults for the trailing ones)
    "narrow": (("dim", "start", "length"), ()),
    "select": (("dim", "index"), ()),
    "transpose": (("dim0", "dim1"), ()),
    "swapaxes": (("axis0", "axis1"), ()),
    "swapdims": (("dim0", "dim1"), ()),
    "movedim": (("source", "destination"), ()),
    "unsqueeze": (("dim",), ()),
    "squeeze": (("dim",), (None,)),
    "flatten": (("start_dim", "end_dim"), (0, -1)),
    "unflatten": (("dim", "sizes"), ()),
    "unbind": (("dim",), (0,)),
}


def _bind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    params, defaults = _SIGNATURES[name]
    values: list[Any] = list(args) + [None] * (len(params) - len(args))
    for i, param in enumerate(params):
        if param in kwargs:
            values[i] = kwargs[param]
        elif i >= len(args):
            first_default = len(params) - len(defaults)
            if i < first_default:
                raise TypeError(f"{name}() missing argument {param!r}")
            values[i] = defaults[i - first_default]
    return values


def _varargs(args: tuple[Any, ...], kwargs: dict[str, Any], *keys: str) -> list[int]:
    for key in keys:
        if key in kwargs:
            return list(kwargs[key])
    if len(args) == 1 and isinstance(args[0], list | tuple):
        return list(args[0])
    return list(args)


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


class LazyConcat(LazyBase):
    """Concatenation of placeholders along ``_dim`` (non-negative).

    ``_pieces[i]`` occupies ``[_offsets[i], _offsets[i] + size_i)`` of ``_dim``. Every
    piece is non-empty and there are at least two (one piece is just that piece).
    """

    _pieces: tuple[LazyBase, ...]
    _offsets: tuple[int, ...]
    _dim: int

    @staticmethod
    def __new__(cls, pieces: list[LazyBase], dim: int, meta: torch.Tensor) -> LazyConcat:
        t: LazyConcat = LazyBase._wrap(cls, meta)
        t._pieces = tuple(pieces)
        t._dim = dim
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += piece.shape[dim]
        t._offsets = tuple(offsets)
        t._recorder = pieces[0]._recorder
        t._meta = meta
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyConcat(dim={self._dim}, pieces={list(self._pieces)!r})"

    def source_names(self) -> list[str]:
        names: dict[str, None] = {}
        for piece in self._pieces:
            names.update(dict.fromkeys(piece.source_names()))
        return list(names)

    def describe(self) -> str:
        names = self.source_names()
        shown = ", ".join(names[:4]) + (f", ... {len(names) - 4} more" if len(names) > 4 else "")
        return f"cat(dim={self._dim})[{shown}]"

    def _detail(self) -> str:
        return f"{len(self._pieces)} pieces"

    def _record_into(self, dest: torch.Tensor, param_name: str) -> None:
        for piece, offset in zip(self._pieces, self._offsets, strict=True):
            piece._record_into(dest.narrow(self._dim, offset, piece.shape[self._dim]), param_name)

    def _cast(self, dtype: torch.dtype) -> LazyBase:
        # A conversion is elementwise: each piece converts its own elements.
        pieces = [p.cast(dtype) for p in self._pieces]
        meta = torch.empty_strided(
            self._meta.shape, self._meta.stride(), dtype=dtype, device="meta"
        )
        return LazyConcat(pieces, self._dim, meta)

    # -- movement ops ------------------------------------------------------------

    def _apply(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        expected = getattr(self._meta, name)(*args, **kwargs)  # eager torch's verdict
        if isinstance(expected, torch.Tensor):
            self._check_result(name, expected)
        resolved = self._resolve(name, args, kwargs, expected)
        got = resolved if isinstance(resolved, tuple) else (resolved,)
        want = expected if isinstance(expected, tuple | list) else (expected,)
        if len(got) != len(want) or any(
            tuple(g.shape) != tuple(w.shape) for g, w in zip(got, want, strict=False)
        ):
            raise self.refuse(f"{name} of a concatenation did not resolve to its pieces")
        if isinstance(resolved, LazyConcat) and isinstance(expected, torch.Tensor):
            # Report the strides eager torch would (a loader may test is_contiguous()).
            return LazyConcat(list(resolved._pieces), resolved._dim, expected)
        return resolved

    def _map(self, fn: Any, dim: int) -> LazyBase:
        return make_concat([fn(p) for p in self._pieces], dim, stack=False)

    def _resolve(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], expected: Any
    ) -> Any:
        nd, d = self.dim(), self._dim
        if name == "contiguous":
            return self  # element placement is unchanged; the sink sees pieces
        if name == "narrow":
            dim, start, length = _bind(name, args, kwargs)
            dim = _norm(dim, nd)
            if dim != d:
                return self._map(lambda p: p.narrow(dim, start, length), d)
            start = _norm(start, self.shape[d])
            return self._take(start, start + length, 1)
        if name == "select":
            dim, index = _bind(name, args, kwargs)
            dim = _norm(dim, nd)
            if dim != d:
                return self._map(lambda p: p.select(dim, index), d - (dim < d))
            index = _norm(index, self.shape[d])
            for piece, offset in zip(self._pieces, self._offsets, strict=True):
                if offset <= index < offset + piece.shape[d]:
                    return piece.select(d, index - offset)
            raise IndexError(f"select index {index} out of range for size {self.shape[d]}")
        if name == "__getitem__":
            return self._getitem(args[0])
        if name in ("transpose", "swapaxes", "swapdims", "t", "permute", "movedim"):
            perm = self._permutation(name, args, kwargs, nd)
            return self._map(lambda p: getattr(p, name)(*args, **kwargs), perm.index(d))
        if name == "unsqueeze":
            (dim,) = _bind(name, args, kwargs)
            dim = _norm(dim, nd + 1)
            return self._map(lambda p: p.unsqueeze(dim), d + (dim <= d))
        if name == "squeeze":
            (dims,) = _bind(name, args, kwargs)
            if dims is None:
                dims = range(nd)
            elif isinstance(dims, int):
                dims = [dims]
            gone = tuple(sorted({_norm(x, nd) for x in dims if self.shape[_norm(x, nd)] == 1}))
            # the concatenated dim has >= 2 elements, so it never squeezes away
            return self._map(lambda p: p.squeeze(gone), d - sum(g < d for g in gone))
        if name in ("chunk", "split"):
            dim = _norm(self._split_dim(args, kwargs), nd)
            sizes = [piece.shape[dim] for piece in expected]  # eager torch's split
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return tuple(
                self._resolve("narrow", (dim, s, n), {}, None)
                for s, n in zip(starts, sizes, strict=True)
            )
        if name == "unbind":
            (dim,) = _bind(name, args, kwargs)
            return tuple(
                self._resolve("select", (dim, i), {}, None)
                for i in range(self.shape[_norm(dim, nd)])
            )
        if name in ("flatten", "unflatten", "view", "reshape"):
            return self._reshape(name, tuple(expected.shape))
        raise self.refuse(f"{name} of a concatenation is not supported")

    @staticmethod
    def _split_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if "dim" in kwargs:
            return int(kwargs["dim"])
        return int(args[1]) if len(args) > 1 else 0

    def _permutation(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], nd: int
    ) -> list[int]:
        """``perm`` with ``result.dim(k)`` = ``self.dim(perm[k])`` for a permuting op."""
        perm = list(range(nd))
        if name == "t":
            if nd == 2:
                perm = [1, 0]
        elif name == "permute":
            perm = [_norm(x, nd) for x in _varargs(args, kwargs, "dims")]
        elif name == "movedim":
            source, destination = _bind(name, args, kwargs)
            src = [source] if isinstance(source, int) else list(source)
            dst = [destination] if isinstance(destination, int) else list(destination)
            src, dst = [_norm(x, nd) for x in src], [_norm(x, nd) for x in dst]
            perm = [-1] * nd
            for s, t in zip(src, dst, strict=True):
                perm[t] = s
            rest = iter(x for x in range(nd) if x not in src)
            perm = [p if p >= 0 else next(rest) for p in perm]
        else:
            a, b = (_norm(x, nd) for x in _bind(name, args, kwargs))
            perm[a], perm[b] = perm[b], perm[a]
        return perm

    def _take(self, start: int, stop: int, step: int) -> LazyBase:
        """Elements ``start, start+step, ... < stop`` of the concatenated dim."""
        d, taken = self._dim, []
        for piece, offset in zip(self._pieces, self._offsets, strict=True):
            end = min(stop, offset + piece.shape[d])
            first = start + max(0, -((start - offset) // step)) * step  # first >= offset
            if first >= end:
                continue
            lo, hi = first - offset, end - offset
            if step == 1:
                whole = lo == 0 and hi == piece.shape[d]
                taken.append(piece if whole else piece.narrow(d, lo, hi - lo))
            else:
                taken.append(piece[(slice(None),) * d + (slice(lo, hi, step),)])
        if not taken:
            empty: LazyBase = self._pieces[0].narrow(d, 0, 0)  # type: ignore[assignment]
            return empty
        return make_concat(taken, d, stack=False)

    def _getitem(self, index: Any) -> Any:
        items = list(index) if isinstance(index, tuple) else [index]
        for item in items:
            if isinstance(item, bool) or not (
                item is None or item is Ellipsis or isinstance(item, int | slice)
            ):
                raise self.refuse(
                    f"__getitem__ with a {type(item).__name__} index is advanced indexing"
                )
        consuming = sum(1 for item in items if item is not None and item is not Ellipsis)
        value: Any = self
        dim = 0
        for item in items:
            if item is Ellipsis:
                dim = value.dim() - consuming  # skip what the items after it do not name
                continue
            if item is None:
                value, dim = value.unsqueeze(dim), dim + 1
                continue
            consuming -= 1
            if isinstance(item, int):
                value = value.select(dim, item)
                continue
            start, stop, step = item.indices(value.shape[dim])
            if step == 1 and start == 0 and stop >= value.shape[dim]:
                pass  # the whole dim: no op to record
            elif step == 1:
                value = value.narrow(dim, start, max(0, stop - start))
            elif not isinstance(value, LazyConcat):
                value = value[(slice(None),) * dim + (slice(start, stop, step),)]
            elif dim == value._dim:
                value = value._take(start, stop, step)
            else:
                strided = (slice(None),) * dim + (slice(start, stop, step),)
                value = value._map(lambda p, index=strided: p[index], value._dim)
            dim += 1
        return value

    def _reshape(self, name: str, target: tuple[int, ...]) -> LazyBase:
        """Push a rank change into the pieces if each stays a block of the new outer dim."""
        source, d = tuple(self.shape), self._dim
        if 0 in source or 0 in target:
            raise self.refuse(f"{name} of an empty concatenation")
        i = j = 0
        while i < len(source):  # find the group of dims (source[i0:i], target[j0:j]) holding d
            i0, j0 = i, j
            p_in, p_out = source[i], target[j] if j < len(target) else 1
            i, j = i + 1, j + 1
            while p_in != p_out:
                if p_in < p_out:
                    p_in, i = p_in * source[i], i + 1
                else:
                    p_out, j = p_out * target[j], j + 1
            if i0 <= d < i:
                break
        if any(s != 1 for s in source[i0:d]):
            raise self.refuse(
                f"{name} merges the concatenated dim {d} under an outer dim: pieces interleave"
            )
        inner_in = math.prod(source[d + 1 : i])
        outer = next((k for k in range(j0, j) if target[k] != 1), j0)
        inner_out = math.prod(target[outer + 1 : j])
        shapes = []
        for piece, offset in zip(self._pieces, self._offsets, strict=True):
            lo, n = offset * inner_in, piece.shape[d] * inner_in
            if lo % inner_out or n % inner_out:
                raise self.refuse(
                    f"{name} to {target} splits a concatenated piece across rows of the new dim"
                )
            shapes.append((*target[:outer], n // inner_out, *target[outer + 1 :]))
        pieces = [p.reshape(s) for p, s in zip(self._pieces, shapes, strict=True)]
        return make_concat(pieces, outer, stack=False)


def make_concat(pieces: list[Any], dim: int, stack: bool) -> LazyBase:
    """The placeholder for ``torch.cat(pieces, dim)`` (``torch.stack`` if ``stack``)."""
    first: LazyBase = pieces[0]
    op = "stack" if stack else "cat"
    for piece in pieces:
        if piece._recorder is not first._recorder:
            raise first.refuse(f"{op} of placeholders from different captures")
        if piece.dtype != first.dtype:
            raise first.refuse(f"{op} of {first.dtype} and {piece.dtype} casts")
    if stack:
        dim = _norm(dim, first.dim() + 1)
        pieces = [p.unsqueeze(dim) for p in pieces]
    else:
        dim = _norm(dim, first.dim())
    expected = _cat_shape(pieces, dim, first, op)
    flat: list[LazyBase] = []
    for piece in pieces:
        if piece.numel() == 0:
            continue  # contributes no element (torch also skips legacy 1-D empties)
        if isinstance(piece, LazyConcat) and piece._dim == dim:
            flat.extend(piece._pieces)
        else:
            flat.append(piece)
    if not flat:
        if tuple(pieces[0].shape) != expected:
            raise first.refuse(f"{op} of empty pieces into shape {expected}")
        empty: LazyBase = pieces[0]
        return empty
    if len(flat) == 1:
        return flat[0]
    return LazyConcat(flat, dim, torch.empty(expected, dtype=first.dtype, device="meta"))


def _cat_shape(pieces: list[LazyBase], dim: int, first: LazyBase, op: str) -> tuple[int, ...]:
    """The shape ``torch.cat`` would produce, with its checks.

    Computed here because ``torch.cat`` on meta tensors pulls in torch's symbolic
    shape machinery on first use (seconds of imports inside a timed capture).
    """
    shaped = [p for p in pieces if not (p.dim() == 1 and p.numel() == 0)] or pieces[:1]
    ref = tuple(shaped[0].shape)
    total = 0
    for piece in shaped:
        shape = tuple(piece.shape)
        if len(shape) != len(ref) or any(
            a != b for k, (a, b) in enumerate(zip(shape, ref, strict=True)) if k != dim
        ):
            raise first.refuse(f"{op} of shapes {ref} and {shape} along dim {dim}")
        total += shape[dim]
    return (*ref[:dim], total, *ref[dim + 1 :])


LazyBase.concat_factory = make_concat
