"""GaLore: gradient low-rank projection (Zhao et al., 2024), with optax.contrib's definition.

Each weight matrix ``G`` (``m x n``) is projected to a rank-``r`` subspace before the base
optimizer sees it: with ``m >= n`` onto its top-``r`` left singular vectors (``P^T G``, ``r x n``),
otherwise onto its top-``r`` right ones (``G P``, ``m x r``). The base optimizer (Adam by default)
keeps its state at that low-rank shape, and its update is projected back (``P U`` or ``U P^T``).
The projector ``P`` is recomputed from an SVD of the current gradient every ``update_proj_gap``
steps, starting at the first; the base optimizer's state carries over unchanged when it is.
Leaves that are not matrices (or that ``weight_dimension_numbers`` skips) go to the base
optimizer whole.

The SVD runs in float32 or the gradient's dtype if wider (optax always uses float32), and the
projector is kept in the gradient's dtype. In eager mode whether a step refreshes the projector is
read from the step counter on the host (one scalar read per step); under ``torch.compile`` or a
``torch.func`` transform it cannot be, so every step computes the SVD and keeps the old projector
where it is not due, which gives the same numbers.

Exact under sharding: with ``spec=`` (plain local shards) or DTensor leaves, each rank's update is
its slice of the update of the whole logical matrix. Only the SVD needs whole gradients: on refresh
steps they are rebuilt on every rank of their shard group, which all compute the same SVDs
(:func:`gradtx.sharding.map_logical`, one ``all_gather`` per shard group and dtype). The projection is a sum over the shard group: each rank
multiplies its block of ``G`` by its rows of ``P`` and the small ``r x n`` (or ``m x r``) shares are
all-reduced, one ``all_reduce`` per shard group per step (exact, in float64), so the projectors
and the low-rank state are whole and the same on every rank of the group (replicated). Projecting
back needs no communication: a rank's block of ``P U`` (or ``U P^T``) takes only the rows and
columns of the two factors that its block spans.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, takes_spec
from gradtx.chains import chain
from gradtx.numerics import ScalarOrSchedule
from gradtx.optimizers._common import check_learning_rate
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import matrices
from gradtx.sharding.spec import ShardingSpec
from gradtx.state_dims import ParamLeaf, state_dims, whole
from gradtx.transforms import _foreach as fe
from gradtx.transforms.adam import scale_by_adam
from gradtx.transforms.scaling import scale_by_learning_rate
from gradtx.transforms.weight_decay import add_decayed_weights


class GaLoreDimensionNumbers(NamedTuple):
    """Which axes of a weight form the projected matrix: ``reduction_axis`` (the input side, the
    matrix's rows) and ``output_axis`` (its columns); several axes are flattened together, in the
    order given. Every axis must be named in one of them (an attention weight
    ``(embed, heads, head_dim)`` is ``GaLoreDimensionNumbers(0, (1, 2))``)."""

    reduction_axis: Union[Sequence[int], int] = 0
    output_axis: Union[Sequence[int], int] = 1


class GaLoreState(NamedTuple):
    """``count``: steps taken (0-d int32); ``base_optimizer_state``: the base optimizer's state, at
    the low-rank shape for projected leaves; ``projector``: per leaf the ``(m, r)`` or ``(n, r)``
    projector, or a ``(0, 0)`` tensor for a leaf that is not projected."""

    count: Tensor
    base_optimizer_state: Any
    projector: Any


def _projected(leaf: ParamLeaf) -> bool:
    """A projected leaf's projector is ``(m, r)`` or ``(n, r)``; any other leaf's a ``(0, 0)`` tensor."""
    return leaf.fields.get("projector") not in (None, (0, 0))


# In a checkpoint: projectors are whole on every rank, and so is the base optimizer's low-rank
# state of a projected leaf; the base state of any other leaf follows its param.
state_dims(projector=whole, base_optimizer_state=lambda leaf: whole(leaf) if _projected(leaf) else None)(GaLoreState)


WeightDimNumOrFn = Union[GaLoreDimensionNumbers, Any, Callable[[Any], Any]]


def _axes(value: Union[Sequence[int], int], ndim: int) -> tuple[int, ...]:
    return (value % ndim,) if isinstance(value, int) else tuple(int(a) % ndim for a in value)


class _Matrix(NamedTuple):
    """How one leaf is seen as a matrix: its permutation, the permuted shape, and ``(m, n)``."""

    permutation: tuple[int, ...]
    permuted_shape: tuple[int, ...]
    m: int
    n: int
    rows: int = 1  # how many of the permuted axes are reduction (row) axes

    def to_matrix(self, x: Tensor) -> Tensor:
        return x.permute(self.permutation).reshape(self.m, self.n)

    def from_matrix(self, x: Tensor) -> Tensor:
        inverse = sorted(range(len(self.permutation)), key=lambda i: self.permutation[i])
        return x.reshape(self.permuted_shape).permute(inverse)


class _LazyPath:
    """A leaf's path, computed only when an error message shows it."""

    def __init__(self, tree: Any, index: int):
        self.tree, self.index = tree, index

    def __repr__(self) -> str:
        return repr(tree_lib.path_at(self.tree, self.index))


def _matrix_of(path: Any, shape: Sequence[int], dim_nums: GaLoreDimensionNumbers, owner: str) -> _Matrix:
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"{owner}: leaf {path!r} has shape {tuple(shape)}; GaLore projects tensors of rank >= 2")
    rows, cols = _axes(dim_nums.reduction_axis, ndim), _axes(dim_nums.output_axis, ndim)
    if set(rows) & set(cols):
        raise ValueError(f"{owner}: leaf {path!r}: reduction axes {rows} and output axes {cols} overlap ({dim_nums})")
    if len(set(rows) | set(cols)) != ndim or len(rows) + len(cols) != ndim:
        raise ValueError(
            f"{owner}: leaf {path!r} of shape {tuple(shape)}: every axis must be named once, got reduction "
            f"axes {rows} and output axes {cols}"
        )
    permutation = rows + cols
    m = n = 1
    for a in rows:
        m *= shape[a]
    for a in cols:
        n *= shape[a]
    return _Matrix(permutation, tuple(shape[a] for a in permutation), m, n, len(rows))


def _dim_nums_leaves(weight_dimension_numbers: Optional[WeightDimNumOrFn], tree: Any, tree_leaves: list) -> list:
    """One ``GaLoreDimensionNumbers`` or ``None`` per leaf of ``tree``, as optax resolves them."""
    if weight_dimension_numbers is None:
        return [GaLoreDimensionNumbers() if x is not None and x.ndim == 2 else None for x in tree_leaves]
    if isinstance(weight_dimension_numbers, GaLoreDimensionNumbers):
        return [weight_dimension_numbers if x is not None and x.ndim >= 2 else None for x in tree_leaves]
    given = weight_dimension_numbers(tree) if callable(weight_dimension_numbers) else weight_dimension_numbers
    try:
        values = tree_lib.structure(tree).flatten_up_to(given)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"scale_by_galore: weight_dimension_numbers do not fit the params: {exc}") from None
    for index, value in enumerate(values):
        if value is not None and not isinstance(value, GaLoreDimensionNumbers):
            raise TypeError(
                f"scale_by_galore: weight_dimension_numbers at {_LazyPath(tree, index)!r} is {value!r}, expected a "
                "GaLoreDimensionNumbers or None"
            )
    return list(values)


def _projector_from_svd(matrix: Tensor, rank: int, left: bool) -> Tensor:
    dtype = torch.promote_types(matrix.dtype, torch.float32)
    u, _, vh = torch.linalg.svd(matrix.to(dtype), full_matrices=False)
    projector = u[:, :rank] if left else vh[:rank, :].mT
    # laid out as ``init`` lays it out: a refresh never changes the state's strides (which would
    # make ``torch.compile`` trace the step again)
    return projector.contiguous().to(matrix.dtype)


def _refresh_on_host(count: Tensor, gap: int) -> Optional[bool]:
    """Whether this step refreshes the projectors, read on the host; ``None`` where it cannot be
    (under ``torch.compile`` or a ``torch.func`` transform)."""
    if torch.compiler.is_compiling() or tree_lib.uses_functorch([count]):
        return None
    return int(count) % gap == 0


# --------------------------------------------------------------------------- sharded pieces
#
# A rank holds a box of the logical leaf: in the matrix view, a set of rows (the box's ranges on
# the reduction axes) times a set of columns (its ranges on the output axes). The projector and the
# low-rank tensors are whole on every rank; a factor indexed by rows or by columns is sliced to the
# box's rows or columns by viewing its first dim as the axes it flattens.


def _side(mat: _Matrix, piece: matrices.Piece, rows: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...]]:
    """``(whole shape, piece shape, piece slices)`` of the row (or column) axes of ``mat``."""
    axes = mat.permutation[: mat.rows] if rows else mat.permutation[mat.rows :]
    shape = tuple(piece.shape[a] for a in axes)
    size = tuple(piece.size[a] for a in axes)
    region = tuple(slice(piece.offset[a], piece.offset[a] + piece.size[a]) for a in axes)
    return shape, size, region


def _rows_of(factor: Tensor, shape: tuple[int, ...], region: tuple[slice, ...]) -> Tensor:
    """The rows of ``factor`` (``prod(shape) x k``) that ``region`` of ``shape`` selects."""
    k = factor.shape[-1]
    return factor.reshape(*shape, k)[region].reshape(-1, k)


def _piece_matrix(local: Tensor, mat: _Matrix) -> Tensor:
    perm = mat.permutation
    size = [local.shape[a] for a in perm]
    return local.permute(perm).reshape(math.prod(size[: mat.rows]), math.prod(size[mat.rows :]))


def _project_piece(local: Tensor, projector: Tensor, mat: _Matrix, piece: matrices.Piece, left: bool) -> Tensor:
    """This piece's share of the low-rank gradient (``P^T G`` or ``G P``), zero outside its columns
    (or rows): the shares of a shard group sum to the whole product."""
    g = _piece_matrix(local, mat)
    if not piece.axes:
        return projector.mT @ g if left else g @ projector
    r = projector.shape[-1]
    if left:  # r x n: this piece's rows of P against its block, into its columns
        shape, _, region = _side(mat, piece, rows=True)
        cols, col_size, col_region = _side(mat, piece, rows=False)
        share = torch.zeros((r, *cols), dtype=g.dtype, device=g.device)
        share[(slice(None),) + col_region] = (_rows_of(projector, shape, region).mT @ g).reshape(r, *col_size)
        return share.reshape(r, mat.n)
    shape, _, region = _side(mat, piece, rows=False)
    rows, row_size, row_region = _side(mat, piece, rows=True)
    share = torch.zeros((*rows, r), dtype=g.dtype, device=g.device)
    share[row_region] = (g @ _rows_of(projector, shape, region)).reshape(*row_size, r)
    return share.reshape(mat.m, r)


def _unproject_piece(update: Tensor, projector: Tensor, mat: _Matrix, piece: matrices.Piece, left: bool, local: Tensor) -> Tensor:
    """This piece's block of ``P U`` (or ``U P^T``), shaped like ``local``."""
    if not piece.axes:
        return mat.from_matrix(projector @ update if left else update @ projector.mT)
    rows, _, row_region = _side(mat, piece, rows=True)
    cols, _, col_region = _side(mat, piece, rows=False)
    if left:  # (m_loc x r) @ (r x n_loc)
        block = _rows_of(projector, rows, row_region) @ _rows_of(update.mT, cols, col_region).mT
    else:  # (m_loc x r) @ (r x n_loc)
        block = _rows_of(update, rows, row_region) @ _rows_of(projector, cols, col_region).mT
    perm = mat.permutation
    inverse = sorted(range(len(perm)), key=lambda i: perm[i])
    return block.reshape(tuple(local.shape[a] for a in perm)).permute(inverse)


@takes_spec
def scale_by_galore(
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 1.0,
    base_optimizer: Optional[GradientTransformation] = None,
    weight_dimension_numbers: Optional[WeightDimNumOrFn] = None,
    *,
    spec: Optional[ShardingSpec] = None,
) -> GradientTransformation:
    """Runs ``base_optimizer`` (default ``scale_by_adam()``) on low-rank projections of the gradient
    matrices and projects its updates back, times ``scale`` (leaves that are not projected get the
    base optimizer's update as it is, unscaled, as in optax).

    ``rank`` is capped at ``min(m, n)`` per matrix; the projector is the top singular vectors of the
    gradient at steps ``0, update_proj_gap, 2 update_proj_gap, ...``. ``weight_dimension_numbers``:
    ``None`` projects the 2-D leaves; one :class:`GaLoreDimensionNumbers` applies to every leaf of
    rank >= 2; a tree of them (``None`` to skip a leaf), or a callable ``params -> tree``.
    The base optimizer is called without params: it must be a pure gradient scaling
    (``scale_by_adam``, ``scale_by_lion``, ...), not ``adamw`` (use ``galore``'s ``weight_decay``).

    ``spec``: the sharding of plain-tensor leaves (DTensor leaves describe themselves). Each rank's
    update is then its slice of the GaLore update of the whole logical matrix; ``m``, ``n`` and the
    projector side are the logical matrix's. The projectors and the base optimizer's low-rank state
    are whole and identical on every rank of a matrix's shard group (replicated; plain tensors);
    leaves that are not projected reach the base optimizer as local shards (or DTensors).
    Collectives per step (after the first, whose cross-rank checks add one ``all_gather`` per kind
    of call): one ``all_reduce`` per distinct shard group of the projected matrices (their shares
    of ``P^T G`` / ``G P``, ``r x n`` or ``m x r``, summed in float64), and on refresh steps one
    ``all_gather`` per shard group and dtype first, which rebuilds the whole gradients for the SVD
    (:func:`gradtx.sharding.map_logical`, strategy ``"gather"``: every rank of the group computes
    the same SVD). Leaves with no sharded axis add nothing. Projecting back is local.
    """
    owner = "scale_by_galore"
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"{owner}: rank must be an int, got {type(rank).__name__}")
    if rank <= 0:
        raise ValueError(f"{owner}: rank must be positive, got {rank}")
    if not isinstance(update_proj_gap, int) or update_proj_gap <= 0:
        raise ValueError(f"{owner}: update_proj_gap must be a positive int, got {update_proj_gap!r}")
    if spec is not None and not isinstance(spec, ShardingSpec):
        raise TypeError(f"{owner}: spec must be a ShardingSpec or None, got {type(spec).__name__}")
    base = base_optimizer if base_optimizer is not None else scale_by_adam()
    # what decides the collectives (the projected sizes, the refresh steps): checked to agree across ranks
    collective_options = {"rank": rank, "update_proj_gap": update_proj_gap}

    def resolve(tree: Any) -> tuple[list, Any, list, Any]:
        """Leaves, treedef, dimension numbers per leaf, and the tree with only the projected leaves."""
        tree_leaves, treedef = tree_lib.flatten(tree)
        dim_nums = _dim_nums_leaves(weight_dimension_numbers, tree, tree_leaves)
        masked = [x if d is not None else None for x, d in zip(tree_leaves, dim_nums)]
        return tree_leaves, treedef, dim_nums, tree_lib.unflatten(treedef, masked)

    def is_sharded(tree_leaves: list) -> bool:
        return spec is not None or dtensor_lib.has_dtensor([x for x in tree_leaves if x is not None])

    def init_fn(params: Any) -> GaLoreState:
        tree_lib.refuse_complex(params, owner=owner, why="its projectors are real singular vectors")
        tree_leaves, treedef, dim_nums, masked = resolve(params)
        # the logical shapes of the projected leaves (their local ones when nothing is sharded)
        shapes = matrices.logical_shapes(masked, spec, what=owner) if is_sharded(tree_leaves) else None
        projectors, proxies = [], []
        for index, (p, d) in enumerate(zip(tree_leaves, dim_nums)):
            if p is None:
                projectors.append(None), proxies.append(None)
            elif d is None:
                projectors.append(torch.zeros((0, 0), dtype=p.dtype, device=p.device))
                proxies.append(torch.zeros_like(p))
            else:
                shape = shapes[index] if shapes is not None else tuple(p.shape)
                mat = _matrix_of(_LazyPath(params, index), shape, d, owner)
                r = min(rank, mat.m, mat.n)
                left = mat.m >= mat.n
                device = dtensor_lib.local(p).device
                projectors.append(torch.zeros((mat.m if left else mat.n, r), dtype=p.dtype, device=device))
                proxies.append(torch.zeros((r, mat.n) if left else (mat.m, r), dtype=p.dtype, device=device))
        return GaLoreState(
            count=fe.zero_count(params),
            base_optimizer_state=base.init(tree_lib.unflatten(treedef, proxies)),
            projector=tree_lib.unflatten(treedef, projectors),
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        tree_leaves, treedef, dim_nums, masked = resolve(updates)
        projector_leaves = tree_lib.flatten_like(state.projector, treedef, updates, what=f"{owner}: state.projector", like="updates")
        sharded = is_sharded(tree_leaves)
        mats: dict[int, _Matrix] = {}

        def validate(index: int, path: Any, shape: tuple[int, ...]) -> None:
            # under sharding this runs before any collective, and every rank gets the error
            mats[index] = _matrix_of(path, shape, dim_nums[index], owner)

        if sharded:
            layout = matrices.local_pieces(masked, spec, what=owner, validate=validate, options=collective_options)
        else:
            for index, (x, d) in enumerate(zip(tree_leaves, dim_nums)):
                if x is not None and d is not None:
                    validate(index, _LazyPath(updates, index), tuple(x.shape))
        refresh = _refresh_on_host(state.count, update_proj_gap)
        due = None if refresh is not None else (state.count % update_proj_gap) == 0
        graph = tree_lib.needs_graph([x for x in tree_leaves if x is not None], list(projector_leaves))

        fresh: dict[int, Tensor] = {}

        def svd_of(index: int, x: Tensor) -> Tensor:
            mat = mats[index]
            fresh[index] = _projector_from_svd(mat.to_matrix(x), min(rank, mat.m, mat.n), mat.m >= mat.n)
            return x

        if refresh is not False and sharded:
            # every rank of a shard group rebuilds the whole gradients and computes the same SVDs
            matrices.map_logical(masked, svd_of, spec, what=owner, strategy="gather", options=collective_options)

        low_rank, new_projectors, shares = [], [], {}
        for index, (g, projector) in enumerate(zip(tree_leaves, projector_leaves)):
            mat = mats.get(index)
            if g is None or mat is None:
                low_rank.append(g)
                keep = projector if (projector is None or inplace) else projector.clone()
                new_projectors.append(keep)
                continue
            left = mat.m >= mat.n
            if refresh is False:
                new = projector if inplace else projector.clone()
            else:
                if index not in fresh:
                    svd_of(index, g)
                new = fresh[index] if refresh else torch.where(due.to(fresh[index].device), fresh[index], projector)
                if inplace and not graph:
                    new = projector.copy_(new)
            new_projectors.append(new)
            if sharded:
                shares[index] = _project_piece(dtensor_lib.local(g), new, mat, layout.pieces[index], left)
                low_rank.append(None)
            else:
                matrix = mat.to_matrix(g)
                low_rank.append(new.mT @ matrix if left else matrix @ new)
        if shares:
            for index, whole in layout.sum(shares).items():
                low_rank[index] = whole

        # low-rank gradients are fresh tensors; unprojected leaves are donated only when the caller does
        base_updates, base_state = base.update(
            tree_lib.unflatten(treedef, low_rank), state.base_optimizer_state, None, inplace=inplace
        )
        base_leaves = tree_lib.flatten_like(base_updates, treedef, updates, what=f"{owner}: base optimizer updates", like="updates")
        outs = []
        for index, (g, u, projector) in enumerate(zip(tree_leaves, base_leaves, new_projectors)):
            mat = mats.get(index)
            if g is None or mat is None:
                outs.append(u)
                continue
            left = mat.m >= mat.n
            local = dtensor_lib.local(g)
            if sharded:
                full = _unproject_piece(u, projector, mat, layout.pieces[index], left, local)
            else:
                full = mat.from_matrix(projector @ u if left else u @ projector.mT)
            full = (scale * full).to(local.dtype)
            full = local.copy_(full) if inplace and not graph else full
            outs.append(dtensor_lib.locals_of([g])[1]([full])[0] if local is not g else full)
        return tree_lib.unflatten(treedef, outs), GaLoreState(
            count=fe.increment(state.count, inplace=inplace),
            base_optimizer_state=base_state,
            projector=tree_lib.unflatten(treedef, new_projectors),
        )

    return GradientTransformation(init_fn, update_fn)


@takes_spec
def galore(
    learning_rate: ScalarOrSchedule,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 1.0,
    base_optimizer: Optional[GradientTransformation] = None,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Optional[Any] = None,
    weight_dimension_numbers: Optional[WeightDimNumOrFn] = None,
    *,
    spec: Optional[ShardingSpec] = None,
) -> GradientTransformation:
    """GaLore: the base optimizer runs on low-rank projections of the gradient matrices.

    Each gradient matrix ``G`` (``m x n``, ``m >= n``) is projected onto its top-``rank`` left
    singular vectors, ``P^T G`` (``rank x n``; the right ones, ``G P``, when ``m < n``); the base
    optimizer (Adam by default) sees and keeps its state at that shape, and its update is
    projected back, ``scale * P U``. The projector comes from an SVD of the gradient every
    ``update_proj_gap`` steps, starting at the first. Then decoupled weight decay in the full
    space and ``-learning_rate``: ``chain(scale_by_galore(...), add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate(learning_rate))``, as optax.contrib's ``galore``. Leaves that
    are not projected reach the base optimizer whole. The optimizer state of an ``m x n``
    matrix is ``rank x n`` (or ``m x rank``) instead of ``m x n``. See :func:`scale_by_galore`.

    Args:
      learning_rate: the step size: a number, a 0-d tensor, or a schedule called with the step
        count (see :mod:`gradtx.schedules`).
      rank: the rank of the projections (capped at ``min(m, n)`` per matrix).
      update_proj_gap: the number of steps between refreshes of a projector.
      scale: multiplies the projected-back update (the paper's ``alpha``).
      base_optimizer: the transformation run on the projected gradients (``None``:
        :func:`~gradtx.scale_by_adam`); it is called without params, so it must be a pure
        scaling of the gradients (give the weight decay here instead).
      weight_decay: the rate of the decoupled weight decay, in the full parameter space: each
        step also subtracts ``learning_rate * weight_decay * param``. A number, a 0-d tensor or a
        schedule.
      mask: the leaves to decay: a tree of bools like the params (or a prefix of it), or a
        callable ``params -> such a tree``; ``None`` decays every leaf.
      weight_dimension_numbers: which leaves are projected, and which of their axes form the
        matrix: one :class:`GaLoreDimensionNumbers` for every leaf of rank 2 or more, a tree of
        them (``None`` to skip a leaf), or a callable ``params -> such a tree``; ``None``
        projects the 2-D leaves.
      spec: a :class:`gradtx.sharding.ShardingSpec` describing how plain-tensor leaves are
        sharded (DTensor leaves need none): each rank's update is then its slice of GaLore's
        update of the whole logical matrix.

    Returns:
      The optimizer, a :class:`~gradtx.GradientTransformation`.

    References:
      Zhao et al., `GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection
      <https://arxiv.org/abs/2403.03507>`_, ICML, 2024

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> params = {"w": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 10.0], [1.0, 0.0, 1.0]])}
      >>> tx = gtx.contrib.galore(learning_rate=0.1, rank=2)  # Adam on 2 x 3 projections
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.2f}")  # the SVD's last bits differ between CPUs
      299.79
      293.70
      287.74
      281.88
      276.12
    """
    check_learning_rate(learning_rate, "galore")
    return chain(
        scale_by_galore(
            rank=rank,
            update_proj_gap=update_proj_gap,
            scale=scale,
            base_optimizer=base_optimizer,
            weight_dimension_numbers=weight_dimension_numbers,
            spec=spec,
        ),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
