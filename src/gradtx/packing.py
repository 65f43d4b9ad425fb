"""Many small tensors as one: an elementwise group step run on packed copies of them.

On the CPU a foreach kernel is a loop over per-tensor kernels, so a step over 100,000 two-element
leaves costs a few microseconds per tensor *per op*, and an Adam step makes about ten ops. A pure
step (new state, new params) may instead copy the small leaves of each list into one flat tensor
(``torch.cat``: one call), run its ops once on those, and hand back views of the results split per
leaf (``split``: one call): the per-tensor cost is paid twice per list instead of once per op.

Only elementwise steps may be packed: each value of every output depends on the values at the
same position of the inputs only, and every output has the inputs' element count. The numbers
are the unpacked step's, bit for bit: the same kernels on the same values, whose results do not
depend on where in a tensor a value sits (``tests/test_packing.py`` checks it on this build against
the unpacked and the donated paths); each new leaf starts at an :data:`ALIGNMENT`-byte boundary,
so what later reads it rounds as it would a tensor of its own. Packed are the
positions whose tensors are plain, dense, contiguous, real floating point, smaller than
:data:`PACK_MAX_ELEMENTS` elements and alike in shape across the lists;
per-position values that are not tensors (flags) split them into packs of equal values. The other
positions take the step as they are. The new leaves are views into one buffer per output, which
no input shares: they stay new tensors, as a pure step promises. (As for any view, ``torch.save``
of one such leaf alone stores its whole buffer; a state saved whole stores each buffer once.)
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from gradtx import torch_internals
from gradtx import tree as tree_lib

PACK_MIN_TENSORS = 16
"""Small tensors in a group from which packing them pays for its two copies (one ``cat`` and one
``split`` per list cost about what one foreach op costs on the same tensors)."""

PACK_MAX_ELEMENTS = 1 << 12
"""Elements below which a tensor counts as small: its own kernel call costs more than its work."""

_PLAIN = (Tensor, torch.nn.Parameter)
_shape = operator.attrgetter("shape")
_layout = operator.attrgetter("layout")


def _kind(seq: Sequence[Any]) -> Optional[bool]:
    """``True`` for a list of plain tensors, ``False`` for one holding no tensor, ``None`` for any
    other (subclasses such as DTensor, or a mix): the list cannot be packed."""
    kinds = set(map(type, seq))
    if kinds <= set(_PLAIN):
        return True
    if not any(issubclass(kind, Tensor) for kind in kinds):
        return False
    return None


ALIGNMENT = 64
"""Bytes each new leaf's data is aligned to, as torch's CPU allocator aligns a tensor of its own:
some kernels (BLAS among them) take another path, and round differently, for unaligned data, so a
packed leaf must not differ from a fresh one there either."""


class _Layout:
    """The shapes of one pack's tensors, and how to copy them into one flat tensor and back. Native
    calls over the whole list throughout: a Python step per tensor would cost what packing saves.

    The inputs are packed end to end (an elementwise kernel's numbers do not depend on where its
    data sits); each output leaf starts at an :data:`ALIGNMENT`-byte boundary of its buffer."""

    def __init__(self, tensors: Sequence[Tensor], dims: list[int], sizes: list[int]) -> None:
        self.sizes = sizes
        self.vectors = dims == [1] * len(dims)  # all 1-d (biases, norms' weights): cat and split
        self.template = list(tensors)  # the shapes to split into (unflatten_dense_tensors)

    def flat(self, tensors: Sequence[Tensor]) -> Tensor:
        if self.vectors:
            return torch.cat(list(tensors))
        return torch_internals.flatten_dense_tensors(list(tensors))

    def split(self, flat: Tensor) -> list[Tensor]:
        if flat.numel() != sum(self.sizes):
            raise RuntimeError("a packed step must be elementwise: an output lost the inputs' element count")
        step = max(1, ALIGNMENT // flat.element_size())
        if all(size % step == 0 for size in self.sizes):  # end to end, every leaf starts aligned
            if self.vectors:
                return list(flat.split(self.sizes))
            return list(torch_internals.unflatten_dense_tensors(flat, self.template))
        n, size = len(self.sizes), self.sizes[0]
        if self.sizes == [size] * n and (self.vectors or len(set(map(_shape, self.template))) == 1):
            # one shape: the rows of a 2-d buffer, each cut to the leaf's size
            rows = flat.new_empty(n, size - size % step + step)[:, :size].copy_(flat.view(n, size))
            return list(rows.unbind(0) if self.vectors else rows.reshape(n, *self.template[0].shape).unbind(0))
        gaps = [-size % step for size in self.sizes]  # padding after each leaf
        padded = self._spread(flat, gaps)
        if self.vectors:
            return list(padded.split([x for pair in zip(self.sizes, gaps) for x in pair]))[0::2]
        spacers = [padded[:gap] for gap in range(step)]
        template = [x for pair in zip(self.template, [spacers[gap] for gap in gaps]) for x in pair]
        return list(torch_internals.unflatten_dense_tensors(padded, template))[0::2]

    def _spread(self, flat: Tensor, gaps: list[int]) -> Tensor:
        """A new 1-d tensor holding ``flat``'s leaves with ``gaps[i]`` unused elements after leaf ``i``."""
        sizes = torch.tensor(self.sizes, device=flat.device)
        gap = torch.tensor(gaps, device=flat.device)
        padded = flat.new_empty(flat.numel() + sum(gaps))
        shift = torch.repeat_interleave(gap.cumsum(0) - gap, sizes)  # the padding before each element
        return padded.index_copy_(0, torch.arange(flat.numel(), device=flat.device) + shift, flat)


def _packable_positions(lists: Sequence[Sequence[Any]], tensor_lists: list[int]) -> Optional[tuple[list[bool], list[int], list[int]]]:
    """Per position, whether its tensors can be packed (see the module's docstring), with the dims
    and element counts of the positions; ``None`` where no position can."""
    first = lists[tensor_lists[0]]
    dims = list(map(Tensor.dim, first))
    sizes = list(map(Tensor.numel, first))
    shapes = None if max(dims, default=0) <= 1 else list(map(_shape, first))
    for k in tensor_lists:
        seq = lists[k]
        if not seq[0].dtype.is_floating_point or set(map(_layout, seq)) != {torch.strided}:
            return None
        if k != tensor_lists[0]:  # alike in shape at every position (else broadcasting, not packing)
            if list(map(Tensor.dim, seq)) != dims or list(map(Tensor.numel, seq)) != sizes:
                return None
            if shapes is not None and list(map(_shape, seq)) != shapes:
                return None
    contiguous = [all(map(Tensor.is_contiguous, lists[k])) for k in tensor_lists]
    if all(contiguous) and max(sizes, default=0) < PACK_MAX_ELEMENTS:
        return [True] * len(sizes), dims, sizes
    eligible = [n < PACK_MAX_ELEMENTS for n in sizes]
    for k, every in zip(tensor_lists, contiguous):
        if not every:
            eligible = [e and c for e, c in zip(eligible, map(Tensor.is_contiguous, lists[k]))]
    return eligible, dims, sizes


def _packs(lists: Sequence[Sequence[Any]], value_lists: list[int], eligible: list[bool]) -> Optional[list[list[int]]]:
    """The eligible positions grouped by their non-tensor values (one pack when every value list is
    uniform); ``None`` where those values cannot be told apart (unhashable)."""
    positions = [i for i, e in enumerate(eligible) if e] if False in eligible else list(range(len(eligible)))
    packs: dict[tuple, list[int]] = {}
    try:
        if all(seq.count(seq[0]) == len(seq) for seq in (lists[k] for k in value_lists)):
            return [positions]
        for i in positions:
            packs.setdefault(tuple(lists[k][i] for k in value_lists), []).append(i)
    except (TypeError, ValueError, RuntimeError):  # values without a plain equality or hash
        return None
    return list(packs.values())


def _run_pack(fn: Callable[..., Sequence[Sequence[Any]]], lists: Sequence[Sequence[Any]], kinds: list[Optional[bool]],
              outputs: int, layout: _Layout) -> list[list[Tensor]]:
    """``fn`` on one pack: each tensor list as one flat tensor, each value list as its (common) value."""
    args = [[layout.flat(seq)] if kinds[k] else [seq[0]] for k, seq in enumerate(lists)]
    return [layout.split(flat) for (flat,) in list(fn(*args))[:outputs]]


def wanted(lists: Sequence[Sequence[Any]]) -> bool:
    """Whether a pure elementwise step over one group's ``lists`` is worth trying packed: enough
    positions, no graph being traced and none recorded (``cat`` and views would change the graph)."""
    if len(lists[0]) < PACK_MIN_TENSORS or torch.compiler.is_compiling():
        return False
    return not tree_lib.needs_graph(*[seq for seq in lists if seq and isinstance(seq[0], Tensor)])


def map_packed(fn: Callable[..., Sequence[Sequence[Any]]], lists: Sequence[Sequence[Any]], outputs: int) -> list[list[Any]]:
    """``fn(*lists)[:outputs]`` for an elementwise ``fn`` (see the module's docstring), with the
    small tensors packed. ``lists`` are one group of ``map_groups``: each list's tensors share a
    device and a dtype."""
    n = len(lists[0])
    kinds = [_kind(seq) for seq in lists]
    tensor_lists = [k for k, kind in enumerate(kinds) if kind]
    value_lists = [k for k, kind in enumerate(kinds) if kind is False]
    found = _packable_positions(lists, tensor_lists) if None not in kinds and tensor_lists else None
    packs = _packs(lists, value_lists, found[0]) if found is not None else None
    packs = [pack for pack in packs or [] if len(pack) >= PACK_MIN_TENSORS]
    if not packs:
        return [list(values) for values in list(fn(*lists))[:outputs]]
    _, dims, sizes = found
    if len(packs) == 1 and len(packs[0]) == n:  # every position in one pack
        return _run_pack(fn, lists, kinds, outputs, _Layout(lists[tensor_lists[0]], dims, sizes))
    packed = [False] * n
    for pack in packs:
        for i in pack:
            packed[i] = True
    rest = [i for i, done in enumerate(packed) if not done]
    results: list[list[Any]] = [[None] * n for _ in range(outputs)]
    for indices in packs + ([rest] if rest else []):  # each pack, then the positions left as they are
        chosen = [[seq[i] for i in indices] for seq in lists]
        if indices is rest:
            values_lists = list(fn(*chosen))[:outputs]
        else:
            layout = _Layout(chosen[tensor_lists[0]], [dims[i] for i in indices], [sizes[i] for i in indices])
            values_lists = _run_pack(fn, chosen, kinds, outputs, layout)
        for out, values in zip(results, values_lists):
            for i, value in zip(indices, values):
                out[i] = value
    return results
