"""Leaf specs: how one gradient leaf is laid out over the named axes of a device mesh.

``Shard(*axes)`` says that ranks along ``axes`` hold disjoint pieces of the leaf; every other mesh
axis holds identical copies. ``Replicate()`` is ``Shard()`` with no axes. ``duplicate=True`` marks a
leaf that repeats one counted elsewhere (the second copy of a tied embedding): it adds nothing to
global sums, though its own per-leaf norm is still the norm of the whole logical tensor.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

DimSpec = Union[int, Sequence[Optional[int]], None]


class Shard:
    """Ranks along ``axes`` hold disjoint pieces of this leaf; other mesh axes hold copies.

    Args:
      *axes: mesh axis names the leaf is split over (their pieces add up).
      duplicate: the leaf repeats one that another rank counts (a tied weight's second copy), so it
        contributes nothing to global sums.
      dim: the tensor dim that is split, one for all axes (``dim=1``) or one per axis
        (``dim=(0, 1)``). Only per-unit norms need it (``adaptive_grad_clip`` on a row-parallel
        weight); a global norm, block RMS or trust ratio does not. DTensors supply it themselves.
    """

    __slots__ = ("axes", "duplicate", "dims")

    def __init__(self, *axes: str, duplicate: bool = False, dim: DimSpec = None):
        for axis in axes:
            if not isinstance(axis, str):
                raise TypeError(f"Shard: mesh axes are names (str), got {axis!r}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"Shard: an axis is named twice in {axes}")
        if dim is not None and not axes:
            raise ValueError(
                f"Shard(dim={dim!r}) names no mesh axis, so it would mean Replicate(): name the axes the "
                "tensor dim is split over, e.g. Shard('dp', dim=0) (gradtx's Shard takes mesh axis names; "
                "the tensor dim is the keyword)"
            )
        if dim is None or isinstance(dim, int):
            dims = (dim,) * len(axes)
        else:
            dims = tuple(dim)
            if len(dims) != len(axes):
                raise ValueError(f"Shard: dim={dim!r} gives {len(dims)} dims for {len(axes)} axes {axes}")
        for d in dims:
            if d is not None and (not isinstance(d, int) or isinstance(d, bool)):
                raise TypeError(f"Shard: dim must be an int or None, got {d!r}")
        self.axes: tuple[str, ...] = tuple(axes)
        self.duplicate: bool = bool(duplicate)
        self.dims: tuple[Optional[int], ...] = dims

    def __repr__(self) -> str:
        args = [repr(a) for a in self.axes]
        if self.duplicate:
            args.append("duplicate=True")
        if any(d is not None for d in self.dims):
            args.append(f"dim={self.dims if len(set(self.dims)) > 1 else self.dims[0]!r}")
        name = "Shard" if self.axes else "Replicate"
        return f"{name}({', '.join(args)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shard) and (self.axes, self.duplicate, self.dims) == (
            other.axes,
            other.duplicate,
            other.dims,
        )

    def __hash__(self) -> int:
        return hash((self.axes, self.duplicate, self.dims))


class Replicate(Shard):
    """Every rank holds an identical copy of this leaf: the same as ``Shard()`` with no axes."""

    __slots__ = ()

    def __init__(self, duplicate: bool = False):
        super().__init__(duplicate=duplicate)


LeafSpec = Shard


def is_leaf_spec(value: object) -> bool:
    return isinstance(value, Shard)
