"""A quantized step taken a few leaves at a time: decode, inner update and encode per group.

Where the inner transformation is elementwise (:func:`gradtx.base.set_elementwise`: Adam, Lion,
momentum, scalings and chains of them), each element's new update and moments depend on that
element alone. So :func:`update_in_groups` runs ``inner.update`` on groups of leaves of about
:func:`group_size` values (4M, or an eighth of the tree; the other leaves ``None``), and on ranges
of rows (or of whole blocks of a row) of larger leaves: only one group's moments exist in float32 at any moment, a step's peak
memory is the new updates plus one group, and the decoded values are still in cache when they are
used. Blocks never straddle two groups, so the codes and scales are the whole-tree step's, bit for
bit, and so are the updates. Unsharded leaves only: a sharded step combines the blocks its pieces
share across ranks after every leaf is updated (one all-reduce), so it takes the whole tree at once.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import donation
from gradtx.quantization import blocks
from gradtx.quantization.placement import WHOLE, Place
from gradtx.quantization.storage import Rounding, StorageFormat, decode, encode_all
from gradtx.sharding.matrices import Piece

GROUP_SIZE = 1 << 22  # values per group at most: 16 MB per float32 moment, in a machine's last-level cache
GROUPS = 8  # and at most an eighth of the tree's values, so that one group's float32 moments and
# temporaries (eager loops: a dozen group-sized ones) stay below the two trees of moments a pure fp32 step makes
MIN_GROUP_SIZE = 1 << 16  # but no group smaller than this (each group is one call of ``inner.update``)


def group_size(total: int) -> int:
    """The values per group for a tree of ``total`` values: :data:`GROUP_SIZE`, or an eighth of
    the tree if less, and no less than :data:`MIN_GROUP_SIZE` (or :data:`GROUP_SIZE` if that is less)."""
    return min(GROUP_SIZE, max(total // GROUPS, MIN_GROUP_SIZE))

Chunk = Optional[tuple[int, int, int, int]]  # rows r0..r1 and columns c0..c1 of a leaf's (rows, columns) view; None: all


def chunks_of(shape: torch.Size, align: int, size: Optional[int] = None) -> list[Chunk]:
    """A leaf of ``shape`` cut into pieces of at most about ``size`` values: runs of whole rows, or,
    for rows longer than ``size``, runs of a row whose cuts fall at multiples of ``align`` columns
    (whole blocks, whole packed bytes). ``[None]`` when the leaf is small enough to be one piece. ``size``: :data:`GROUP_SIZE` unless given."""
    size = GROUP_SIZE if size is None else size
    rows, columns = blocks.row_count(shape), (shape[-1] if len(shape) else 1)
    if rows * columns <= size:
        return [None]
    if columns <= size:
        step = size // columns
        return [(r, min(r + step, rows), 0, columns) for r in range(0, rows, step)]
    step = max(size // align, 1) * align
    return [(r, r + 1, c, min(c + step, columns)) for r in range(rows) for c in range(0, columns, step)]


def plan(numels: Sequence[Optional[int]], streamable: Sequence[bool], shapes: Sequence[Any], align: int) -> list[list[tuple[int, Chunk]]]:
    """Groups of ``(leaf, chunk)``: consecutive whole leaves until a group holds :func:`group_size`
    values, and each piece of a larger ``streamable`` leaf (one whose every moment is stored) alone.
    Leaves with no gradient (``numels[i] is None``) are in no group."""
    groups: list[list[tuple[int, Chunk]]] = []
    current: list[tuple[int, Chunk]] = []
    size, most = 0, group_size(sum(n for n in numels if n is not None))
    for i, numel in enumerate(numels):
        if numel is None:
            continue
        pieces = chunks_of(shapes[i], align, most) if streamable[i] else [None]
        if pieces != [None]:
            groups.extend([[(i, piece)] for piece in pieces])
            continue
        current.append((i, None))
        size += numel
        if size >= most:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _rows(x: Tensor, chunk: Chunk) -> Tensor:
    """``x``'s piece ``chunk`` as a ``(rows, columns)`` tensor (a view where ``x`` is contiguous)."""
    if chunk is None:
        return x
    r0, r1, c0, c1 = chunk
    return x.reshape(blocks.row_count(x.shape), x.shape[-1] if x.ndim else 1)[r0:r1, c0:c1]


def _piece(shape: torch.Size, chunk: tuple[int, int, int, int]) -> Piece:
    """Where the piece ``chunk`` lies in its leaf's ``(rows, columns)`` view: the same row-major
    indices as in the leaf, which key the random bits of its stochastic rounding."""
    r0, r1, c0, c1 = chunk
    rows, columns = blocks.row_count(shape), (shape[-1] if len(shape) else 1)
    return Piece((rows, columns), (r1 - r0, c1 - c0), (r0, c0), ())


class _Stored:
    """One stored leaf's codes and scales, read and written a piece at a time on its ``(rows, columns)`` view."""

    def __init__(self, codes: Tensor, scales: Optional[Tensor], placeholder: Tensor, fmt: StorageFormat) -> None:
        self.codes, self.scales, self.placeholder, self.fmt = codes, scales, placeholder, fmt
        self.new_codes: Optional[Tensor] = None
        self.new_scales: Optional[Tensor] = None

    def _views(self, codes: Tensor, scales: Optional[Tensor], chunk: tuple[int, int, int, int]) -> tuple[Tensor, Optional[Tensor]]:
        r0, r1, c0, c1 = chunk
        rows = codes.reshape(blocks.row_count(codes.shape), -1) if codes.ndim else codes.reshape(1, 1)
        if self.fmt.packed:
            c0, c1 = c0 // 2, -(-c1 // 2)
        piece = rows[r0:r1, c0:c1]
        if scales is None:
            return piece, None
        size = self.fmt.block_size
        per_row = scales.reshape(rows.shape[0], -1)
        return piece, per_row[r0:r1, chunk[2] // size : -(-chunk[3] // size)]

    def read(self, chunk: Chunk) -> Tensor:
        """The piece ``chunk`` of the leaf, decoded (the whole leaf for ``None``)."""
        if chunk is None:
            return decode(self.codes, self.scales, self.placeholder, self.fmt)
        codes, scales = self._views(self.codes, self.scales, chunk)
        r0, r1, c0, c1 = chunk
        placeholder = self.placeholder.new_empty((r1 - r0, c1 - c0, 0))
        return decode(codes, scales, placeholder, self.fmt, Place(column=c0))

    def write(self, chunk: tuple[int, int, int, int], codes: Tensor, scales: Optional[Tensor]) -> None:
        """Stores the encoded piece ``chunk``."""
        if self.new_codes is None:
            self.new_codes = torch.empty_like(self.codes)
            self.new_scales = None if self.scales is None else torch.empty_like(self.scales)
        codes_view, scales_view = self._views(self.new_codes, self.new_scales, chunk)
        codes_view.copy_(codes.reshape(codes_view.shape))
        if scales_view is not None:
            scales_view.copy_(scales.reshape(scales_view.shape))  # type: ignore[union-attr]


class Step(NamedTuple):
    """One eager step of :func:`gradtx.quantize_state` on unsharded leaves, as its routes
    (:func:`update_in_groups`, :func:`gradtx.quantization.direct.update_directly`) take it.

    ``inner_update``: the inner transformation's update; ``updates``, ``params``: the step's trees;
    ``leaves``: the inner state's leaves (placeholders where stored), of structure ``state_def``;
    ``starts``: where each params-shaped part begins among them; ``codes`` and ``scales``: per part,
    per param, the stored ones (``None`` where not stored); ``signed``: per part, whether it uses the
    signed map; ``fmt``: the storage; ``inplace`` and ``extra_args``: as ``update`` got them;
    ``check``: the leaves of a new inner state, or an error if its structure is not ``state_def``."""

    inner_update: Callable
    updates: Any
    params: Any
    leaves: list[Any]
    state_def: Any
    starts: Sequence[int]
    codes: list[list[Any]]
    scales: list[list[Any]]
    signed: Sequence[bool]
    fmt: StorageFormat
    inplace: Any
    extra_args: dict
    check: Callable[[Any], list[Any]]


def update_in_groups(
    step: Step, rounding_of: Callable[..., list[Optional[Rounding]]]
) -> Optional[tuple[Any, list[Any], list[list[Any]], list[list[Any]]]]:
    """The ``step`` of :func:`gradtx.quantize_state`, a group at a time (see the module's docstring),
    or ``None`` when no leaf has a gradient (the caller then takes the whole tree).

    ``rounding_of(which, pieces, signed)``: what the stochastic rounding of leaves ``which``
    (``(part, param index)``) draws from (or ``None``s), ``pieces`` where each lies in its logical
    tensor (``None``: the whole of it), so a range of rows draws the whole leaf's bits for its
    elements. Returns the new updates, the new inner state's leaves, codes and scales."""
    inner_update, updates, params, leaves, state_def, starts, codes, scales, signed, fmt, inplace, extra_args, check = step
    grads, updates_def = tree_lib.flatten(updates)
    param_leaves = tree_lib.flatten(params)[0] if params is not None else None
    count = len(grads)
    positions = {start + i for start in starts for i in range(count)}
    stored = [[None if codes[p][i] is None else _Stored(codes[p][i], scales[p][i], leaves[starts[p] + i], fmt)
               for i in range(count)] for p in range(len(starts))]
    present = [isinstance(g, Tensor) for g in grads]
    streamable = [present[i] and all(stored[p][i] is not None for p in range(len(starts))) for i in range(count)]
    align = math.lcm(fmt.block_size or 1, 2 if fmt.packed else 1)
    groups = plan([g.numel() if present[i] else None for i, g in enumerate(grads)], streamable, [g.shape if isinstance(g, Tensor) else None for g in grads], align)
    if not groups:
        return None
    new_updates: list[Any] = [None] * count
    new_leaves = list(leaves)
    # A donated state's counts are stepped in place by the group that gets them: every group after
    # the first starts from a copy of their values before the step, so each steps them once, as a
    # whole-tree step does (else Adam's count, and its bias correction, would advance per group)
    _, state_donated = donation(inplace)
    before = {k: leaf.clone() for k, leaf in enumerate(leaves) if k not in positions and isinstance(leaf, Tensor)} if state_donated else {}
    new_codes = [list(c) for c in codes]
    new_scales = [list(s) for s in scales]
    for number, group in enumerate(groups):
        sub_updates: list[Any] = [None] * count
        sub_params: list[Any] = [None] * count
        sub_state = [None if k in positions else before[k].clone() if number and k in before else leaf for k, leaf in enumerate(leaves)]
        for i, chunk in group:
            sub_updates[i] = _rows(grads[i], chunk)
            if param_leaves is not None and isinstance(param_leaves[i], Tensor):
                sub_params[i] = _rows(param_leaves[i], chunk)
            for p, start in enumerate(starts):
                keeper = stored[p][i]
                sub_state[start + i] = keeper.read(chunk) if keeper is not None else leaves[start + i]
        result, new_inner = inner_update(
            tree_lib.unflatten(updates_def, sub_updates),
            tree_lib.unflatten(state_def, sub_state),
            None if param_leaves is None else tree_lib.unflatten(updates_def, sub_params),
            inplace=inplace,
            **extra_args,
        )
        check(new_inner)
        result_leaves = tree_lib.flatten(new_inner)[0]
        result_updates = tree_lib.flatten(result)[0]
        del result, new_inner, sub_state, sub_updates, sub_params  # no group's float32 moments outlive it
        whole: list[tuple[int, int]] = []  # (part, param) of the group's whole stored leaves, encoded together
        for i, chunk in group:
            if chunk is None:
                new_updates[i] = result_updates[i]
            else:  # into the leaf's new update, allocated at its first piece
                if new_updates[i] is None:
                    new_updates[i] = result_updates[i].new_empty(grads[i].shape)
                _rows(new_updates[i], chunk).copy_(result_updates[i])
            for p, start in enumerate(starts):
                keeper = stored[p][i]
                if keeper is None:
                    new_leaves[start + i] = result_leaves[start + i]
                elif chunk is None:
                    whole.append((p, i))
                else:
                    piece = [result_leaves[start + i]]
                    rounding = rounding_of([(p, i)], [_piece(grads[i].shape, chunk)], [signed[p]])
                    ((piece_codes, piece_scales),) = encode_all(piece, fmt, [Place(column=chunk[2])], None, [signed[p]], rounding)
                    keeper.write(chunk, piece_codes, piece_scales)
        whole_leaves = [result_leaves[starts[p] + i] for p, i in whole]
        whole_signed = [signed[p] for p, _ in whole]
        rounding = rounding_of(whole, [None] * len(whole), whole_signed)
        encoded = encode_all(whole_leaves, fmt, [WHOLE] * len(whole), None, whole_signed, rounding)
        for (p, i), (c, s) in zip(whole, encoded):
            new_codes[p][i], new_scales[p][i] = c, s
        for k, leaf in enumerate(result_leaves):  # what is not params-shaped (step counts) is alike in every group's result
            if k not in positions:
                new_leaves[k] = leaf
        result_leaves = result_updates = encoded = whole_leaves = []  # (not del: Dynamo traces no deletion of a variable a comprehension reads)
    for p in range(len(starts)):
        for i in range(count):
            keeper = stored[p][i]
            if keeper is not None and keeper.new_codes is not None:
                new_codes[p][i], new_scales[p][i] = keeper.new_codes, keeper.new_scales
    return tree_lib.unflatten(updates_def, new_updates), new_leaves, new_codes, new_scales
