"""``quantize_state``: a transformation whose large per-element moments are stored quantized.

``quantize_state(adamw(1e-3))`` keeps AdamW's ``mu`` and ``nu`` as 8-bit codes plus one float32
scale per block of 256 values: about 2 bytes per parameter instead of 8. Each ``update``
dequantizes the stored moments, runs the inner transformation on them, and quantizes the new ones.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import (
    runs_inner,
    takes_spec,
    DONATE_UPDATES,
    GradientTransformation,
    GradientTransformationExtraArgs,
    donation,
    is_elementwise,
    returns_new_updates,
    scaled_update_of,
    supports_donated_updates,
    takes_donated_updates,
    takes_extra_args,
    takes_scaled_gradients,
    with_inplace,
)
from gradtx.native import stored_adam
from gradtx.quantization.direct import update_directly
from gradtx.quantization.placement import place_of
from gradtx.quantization.storage import Rounding, StorageFormat, decode, encode_all, rounding_keys, storage_format
from gradtx.quantization.streaming import Step, update_in_groups
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding.edges import row_cuts
from gradtx.sharding.mesh import MeshAxes
from gradtx.sharding.matrices import Piece
from gradtx.sharding.reductions import is_sharded
from gradtx.sharding.spec import DEFAULT_TIMEOUT_S, ShardingSpec
from gradtx.state_check import examined, name_of, named
from gradtx.state_dims import Dims, ParamLeaf, same, state_dims
from gradtx.state_signs import nonnegative_fields
from gradtx.transforms import _foreach as fe

PyTree = Any

# --------------------------------------------------------------------------- the state and its layout


def _placeholder_dims(leaf: ParamLeaf) -> Optional[Dims]:
    """A stored leaf's placeholder (``(*param_shape, 0)``) is laid out as its param, plus an empty dim."""
    if leaf.leaf_shape == leaf.local_shape + (0,):
        return same(leaf) + (None,)
    return None  # any other leaf: the inner state's own declaration, or the default


def _block_dims(leaf: ParamLeaf) -> Optional[Dims]:
    """Codes and scales follow the param along its leading dims; along the last dim (blocks,
    packed pairs) only while the param is whole along it. Otherwise no declaration here, and the
    checkpoint refuses the leaf: pieces split along the last dim may hold parts of the same block
    (its scale on two ranks, overlapping chunks) and the rule cannot see the block size to tell."""
    if leaf.leaf_shape == leaf.local_shape:
        return same(leaf)
    if not leaf.shape:  # a 0-d param: one block
        return (None,) * len(leaf.leaf_shape)
    if len(leaf.leaf_shape) == len(leaf.shape) and leaf.local_shape[-1] == leaf.shape[-1]:
        return tuple(range(len(leaf.shape) - 1)) + (None,)
    return None


@state_dims(inner=_placeholder_dims, codes=_block_dims, scales=_block_dims)
class QuantizedState(NamedTuple):
    """The state of :func:`quantize_state`.

    Attributes:
      inner: the inner transformation's state, where each stored leaf is replaced by an empty
        tensor of shape ``(*leaf.shape, 0)`` and the leaf's dtype and device (no memory; it says
        what the leaf is read back as).
      codes: one tree like the params per params-shaped part of ``inner`` (its moments, in the
        order they are flattened): each stored leaf's codes (``uint8``, two 4-bit codes per byte
        along the last dim, or the storage dtype), ``None`` elsewhere.
      scales: trees like ``codes``: each stored leaf's float32 block scales, shaped
        ``(*leaf.shape[:-1], blocks)`` (the block's absmax; its sign bit set where the signed map
        is used: every block of a field not declared non-negative), ``None`` where there are none
        (``torch.bfloat16`` storage).
      count: the updates so far (0-d int32): with the seed, the stream of the random bits of
        stochastic rounding (4 bits), so a state saved and loaded rounds as an uninterrupted run.
      stored_as: an empty ``uint8`` tensor (no memory) shaped ``(storage, block_size, 0)``: how the
        codes were written (``storage`` 8 or 4 for the code books, 100 plus the bits for a float
        dtype: 116 bfloat16, 108 float8; ``block_size`` 0 without blocks). ``update`` refuses a
        state stored otherwise than it stores, and a checkpoint's manifest records the shape, so
        codes of blocks of 256 are never read as blocks of 160 where both give a row as many blocks.
    """

    inner: Any
    codes: tuple
    scales: tuple
    count: Tensor
    stored_as: Tensor


def storage_shape(fmt: StorageFormat) -> tuple[int, int, int]:
    """The shape of ``fmt``'s :attr:`QuantizedState.stored_as`."""
    storage = fmt.storage if isinstance(fmt.storage, int) else 100 + torch.finfo(fmt.storage).bits
    return (storage, fmt.block_size, 0)


def storage_mark(fmt: StorageFormat, device: Any = None) -> Tensor:
    """The :attr:`QuantizedState.stored_as` of ``fmt``."""
    return torch.empty(storage_shape(fmt), dtype=torch.uint8, device=device)


def _storage_text(shape: Sequence[int]) -> str:
    storage, block_size = shape[0], shape[1]
    kind = f"{storage}-bit codes" if storage < 100 else f"{storage - 100}-bit float values"
    return f"{kind} in blocks of {block_size}" if block_size else f"{kind} without blocks"


# --------------------------------------------------------------------------- which leaves are stored


def params_parts(state_def: Any, params_def: Any) -> tuple[int, ...]:
    """:func:`find_params_parts`, remembered per pair of structures (found anew while compiling)."""
    if torch.compiler.is_compiling():
        return find_params_parts(state_def, params_def)
    return _remembered_parts(state_def, params_def)


def find_params_parts(state_def: Any, params_def: Any) -> tuple[int, ...]:
    """Where each params-shaped part of a state begins among its leaves (outermost parts; as
    :mod:`gradtx.checkpoint` finds them): the state's moments, momentum buffers, accumulators."""
    return tuple(start for start, _ in _walk_parts(state_def, params_def))


def find_nonnegative_parts(state_def: Any, params_def: Any) -> tuple[bool, ...]:
    """For each part :func:`find_params_parts` finds, whether it lies in a field its state type
    declares non-negative (:func:`gradtx.state_signs.nonnegative`: a second moment, a sum of squares)."""
    return tuple(nonnegative for _, nonnegative in _walk_parts(state_def, params_def))


def _walk_parts(state_def: Any, params_def: Any) -> list[tuple[int, bool]]:
    """``(start, non-negative)`` of each params-shaped part of a state, in the order of its leaves."""
    found: list[tuple[int, bool]] = []

    def walk(spec: Any, start: int, nonnegative: bool) -> None:
        if spec == params_def:
            found.append((start, nonnegative))
            return
        if spec.is_leaf():
            return
        fields = getattr(spec.type, "_fields", None)
        declared = nonnegative_fields(spec.type)
        for i, child in enumerate(spec.children()):
            inside = nonnegative or (fields is not None and i < len(fields) and fields[i] in declared)
            walk(child, start, inside)
            start += child.num_leaves

    walk(state_def, 0, False)
    return found


_remembered_parts = functools.lru_cache(maxsize=256)(find_params_parts)
_remembered_nonnegative = functools.lru_cache(maxsize=256)(find_nonnegative_parts)


def nonnegative_parts(state_def: Any, params_def: Any) -> tuple[bool, ...]:
    """:func:`find_nonnegative_parts`, remembered per pair of structures (found anew while compiling)."""
    if torch.compiler.is_compiling():
        return find_nonnegative_parts(state_def, params_def)
    return _remembered_nonnegative(state_def, params_def)


def _stored(leaf: Any, param: Any, numel: int, min_size: int) -> bool:
    """Whether a state leaf made from ``param`` is stored quantized: a real floating tensor of the
    param's shape, whose param has at least ``min_size`` elements (and has some) as a whole
    logical tensor (``numel`` of them)."""
    return (
        isinstance(leaf, Tensor)
        and isinstance(param, Tensor)
        and leaf.is_floating_point()
        and leaf.shape == param.shape
        and numel >= max(min_size, 1)
    )


def _plain(updates: PyTree, params: PyTree) -> bool:
    """Whether every leaf of ``updates`` and ``params`` is a plain tensor or ``None`` (no DTensor)."""
    trees = (updates,) if params is None else (updates, params)
    return not any(dtensor_lib.is_dtensor(leaf) for tree in trees for leaf in tree_lib.leaves(tree))


# --------------------------------------------------------------------------- the transformation


@takes_spec
def quantize_state(
    inner: GradientTransformation,
    bits: Union[int, torch.dtype] = 8,
    *,
    block_size: Optional[int] = None,
    min_size: int = 4096,
    spec: Optional[ShardingSpec] = None,
    seed: int = 0,
) -> GradientTransformation:
    """``inner`` with its per-element moments stored in 8 or 4 bits (or bfloat16, or float8).

    Every floating leaf of ``inner``'s state that mirrors a param (same shape as its param, in a
    part of the state shaped like the params: Adam's ``mu`` and ``nu``, a momentum buffer,
    Lion's momentum, contrib optimizers' moments) and whose param has at least ``min_size``
    elements is stored as codes plus per-block scales; everything else (step counts, small
    leaves, factored statistics) stays exactly as ``inner`` keeps it. ``update`` dequantizes the
    stored leaves, runs ``inner.update`` on them, and quantizes the new ones.

    Blocks follow the logical tensor: a block is a run of ``block_size`` elements along the last
    dim, within one row (a 1-D leaf: along its only dim). A block is divided by its absolute
    maximum (its scale, kept in float32) and each value is stored as the nearest value of a
    non-linear map (the same inputs give the same codes, always). Which map a leaf uses is
    decided by the state field it belongs to, never by its values: a field its state type
    declares non-negative (:func:`gradtx.state_signs.nonnegative`: Adam's ``nu``, AMSGrad's
    ``nu_max``, RMSProp's and AdaGrad's accumulators) uses the unsigned map, every other field
    (a first moment, a momentum, an undeclared field) the signed one, with its zero: a momentum
    block that happens to be all positive keeps its small entries small. The choice is recorded
    in the sign bit of every scale. So nothing depends on the data or on how the state is laid
    out, and any inner transformation works.

    - ``bits=8``: Dettmers et al.'s dynamic tree maps, signed and unsigned; blocks of 256.
    - ``bits=4``: Li et al.'s dynamic exponent map (signed) and linear map without zero
      (unsigned: a second moment never reads back as zero, which would blow up ``1/sqrt(nu)``);
      blocks of 128; two codes per byte along the last dim. The signed fields (first moments,
      momenta) are rounded *stochastically* to one of the two map values around each value, the
      upper with the probability that makes the stored value unbiased; the unsigned ones to
      nearest. An EMA such as Adam's ``mu`` moves by ``(1 - b1) * (g - mu)`` a step, often less
      than half the gap between 4-bit codes, so rounded to nearest it stays on its code and the
      momentum stalls (on a small GPT, AdamW's final loss doubles); rounded stochastically it
      moves on average as in float32. The random bits hash (``seed``, the step count in the
      state, the param's path, the field, the element's index in the logical tensor), so they
      are the same under any sharding and after a checkpoint is loaded.
    - ``bits=torch.float8_e4m3fn``: each block scaled so its absmax is 448 and cast (round to
      nearest); blocks of 256.
    - ``bits=torch.bfloat16``: a plain cast (round to nearest), no blocks.

    A non-finite value makes its whole block read back non-finite (never silently finite).

    Memory and speed: between steps the stored leaves take their codes and scales only (about 2
    bytes per param for AdamW at 8 bits, 1 at 4 bits). When ``inner`` is elementwise (Adam, Lion,
    momentum, scalings and chains of them: :func:`gradtx.base.is_elementwise`) and the leaves are
    not sharded, ``update`` decodes, updates and encodes a group of leaves (4M values, or an eighth
    of the tree if less; a range of rows of a larger leaf) at a time (:mod:`~gradtx.quantization.streaming`), so a pure
    step holds the new updates, the new codes and one group's float32 moments, below a pure fp32
    step's new moments and updates; otherwise (a global-norm clip inside ``inner``, a sharded
    tree, a traced step such as ``compile_step``'s) it decodes every stored leaf, runs
    ``inner.update`` once, and encodes them all, with the same numbers either way. An eager
    8-bit ``adam``/``adamw`` (no Nesterov, no ``eps_root``) steps its stored moments where they lie,
    a block at a time in C (:mod:`~gradtx.quantization.direct`): no float32 moment outside a
    block, one ``inner.update`` for the tree; after a ``clip_by_global_norm`` in a ``chain`` it
    also takes the clip's coefficient where it reads the gradients (no scaled copy of them).
    Eagerly, the code books' per-value work (block absmax, codes to nearest or stochastically
    rounded, values) runs in a C kernel, one pass each
    (:mod:`gradtx.native.codebook`, built on first use); where it cannot be built, or with
    ``GRADTX_NATIVE=0``, as one compiled loop (``torch.compile``) for leaves of 2**16 values or
    more: ``GRADTX_QUANTIZE_COMPILE=0`` keeps it eager, ``=1`` compiles it for every leaf
    (:mod:`~gradtx.quantization.kernels`), and the stochastic rounding of 4-bit first moments
    eagerly, 2**14 values at a time (its draws are int64; a traced step takes each leaf whole).
    The codes are the same every way.

    Args:
      inner: the transformation whose state is stored quantized (``adamw(...)``, a chain, ...).
      bits: the storage: ``8``, ``4``, ``torch.bfloat16`` or ``torch.float8_e4m3fn``.
      block_size: the block length (default 256; 128 for 4 bits). Not taken with bfloat16.
      min_size: leaves whose param has fewer elements are kept as ``inner`` keeps them
        (quantizing a bias saves little and costs accuracy).
      spec: how plain params are sharded (a :class:`~gradtx.sharding.ShardingSpec`; DTensor
        params describe themselves). Each rank's codes and scales are its pieces of the dense
        run's, bit for bit: blocks are found from the piece's place in the logical tensor. A piece
        split along leading dims holds whole blocks (FSDP2's ``Shard(0)``, HSDP, TP row splits):
        no communication. A piece split along the last dim at a column inside a block (TP
        ``Shard(1)``, a flat ZeRO piece: a 1-D leaf, whose logical tensor is the flat vector)
        shares that block with its neighbour: the blocks so shared get their absmax and sign by
        one all-reduce per step per distinct group, for all leaves at once. A plain split must name
        its dim unless the leaf is 1-D (``Shard("tp", dim=1)``); plain pieces may be uneven (any
        sizes that form a grid, numpy's ``array_split`` say): their sizes are exchanged once
        (:mod:`gradtx.sharding.elements`), on the first step of a new layout.
        Checkpoints (:mod:`gradtx.checkpoint`, DCP) hold such state when the params are whole
        along their last dim; a param split along it is a ``ValueError`` naming the leaf (its
        scales, and 4-bit codes, are no partition of the dense ones).
      seed: the seed of stochastic rounding's random bits (4 bits; unused otherwise).

    Returns:
      A transformation with ``inner``'s updates, whose state is a :class:`QuantizedState`. It
      takes ``update``'s extra arguments when ``inner`` does.

    References:
      Dettmers, Lewis, Shleifer & Zettlemoyer, `8-bit Optimizers via Block-wise Quantization
      <https://arxiv.org/abs/2110.02861>`_, ICLR, 2022

      Li, Chen & Zhu, `Memory Efficient Optimizers with 4-bit States
      <https://arxiv.org/abs/2309.01507>`_, NeurIPS, 2023

    Examples:
      >>> import torch
      >>> import gradtx as gtx
      >>> params = {"w": torch.linspace(-1.0, 1.0, 8192)}
      >>> def f(params):  # a quadratic, smallest at w = 0
      ...     return (params["w"] ** 2).sum()
      >>> tx = gtx.quantize_state(gtx.adamw(learning_rate=0.1), bits=8)  # AdamW fp32: 1993.9 ... 392.2
      >>> state = tx.init(params)
      >>> state.codes[0]["w"].dtype, tuple(state.scales[0]["w"].shape)  # mu's codes and its 32 blocks' scales
      (torch.uint8, (32,))
      >>> for _ in range(5):
      ...     grads = torch.func.grad(f)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = gtx.apply_updates(params, updates)
      ...     print(f"{f(params):.1f}")
      1993.9
      1406.1
      955.8
      623.9
      390.6
    """
    owner = "quantize_state"
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"{owner}: inner must be a GradientTransformation, got {type(inner).__name__}")
    fmt = storage_format(bits, block_size, owner=owner)
    expected_mark = storage_shape(fmt)
    timeout = spec.timeout if isinstance(spec, ShardingSpec) else DEFAULT_TIMEOUT_S  # DTensors alone: a spec's default
    if not isinstance(min_size, int) or isinstance(min_size, bool):
        raise TypeError(f"{owner}: min_size must be an int, got {type(min_size).__name__}")
    if min_size < 0:
        raise ValueError(f"{owner}: min_size must be >= 0, got {min_size}")
    if spec is not None and not isinstance(spec, ShardingSpec):
        raise TypeError(f"{owner}: spec must be a gradtx.sharding.ShardingSpec or None, got {type(spec).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"{owner}: seed must be an int, got {type(seed).__name__}")
    inner_update = with_inplace(inner)
    extra = takes_extra_args(inner)
    elementwise = is_elementwise(inner)
    direct = stored_adam.declared(inner.update) and fmt.storage == 8  # the Adam step on the codes themselves

    def layout_of(tree: PyTree) -> tuple[Optional[MeshAxes], list[Any]]:
        """The mesh and every leaf's :class:`~gradtx.sharding.edges.RowCuts` (``None``: unsharded)."""
        tree_leaves = tree_lib.leaves(tree)
        if not is_sharded(tree_leaves, spec):
            return None, [None] * len(tree_leaves)
        return row_cuts(tree, spec, what=owner)

    def init_fn(params: PyTree) -> QuantizedState:
        param_leaves, params_def, _ = tree_lib.tensor_leaves(params, what="params")
        mesh, cuts = layout_of(params)
        inner_state = inner.init(params)
        leaves, state_def = tree_lib.flatten(inner_state)
        found = []
        nonnegative = nonnegative_parts(state_def, params_def)
        for part, start in enumerate(params_parts(state_def, params_def)):
            for i, param in enumerate(param_leaves):
                numel = math.prod(cuts[i].piece.shape) if cuts[i] is not None else dtensor_lib.local(param).numel() if isinstance(param, Tensor) else 0
                if _stored(leaves[start + i], param, numel, min_size):
                    found.append((start + i, part, i))
        count = fe.zero_count(params)
        codes, scales = store(leaves, found, nonnegative, tree_lib.paths(params), mesh, cuts, count)
        return QuantizedState(
            tree_lib.unflatten(state_def, leaves),
            tuple(tree_lib.unflatten(params_def, c) for c in codes),
            tuple(tree_lib.unflatten(params_def, s) for s in scales),
            count,
            storage_mark(fmt, count.device),
        )

    def store(
        leaves: list[Any],
        found: list[tuple[int, int, int]],
        nonnegative: Sequence[bool],
        paths: Sequence[str],
        mesh: Optional[MeshAxes],
        cuts: list[Any],
        count: Tensor,
    ) -> tuple[list[list[Any]], list[list[Any]]]:
        """Codes and scales (per part, per param) of the ``found`` leaves, which become placeholders;
        ``nonnegative``: per part, whether its field is declared non-negative (the unsigned map);
        ``paths``: the params' paths, which with ``count`` key the random bits of stochastic rounding."""
        codes = [[None] * len(paths) for _ in nonnegative]
        scales = [[None] * len(paths) for _ in nonnegative]
        places = [place_of(cuts[i], fmt.block_size) for _, _, i in found]
        signed = [not nonnegative[part] for _, part, _ in found]
        local = [dtensor_lib.local(leaves[index]) for index, _, _ in found]
        pieces = [cuts[i].piece if cuts[i] is not None else None for _, _, i in found]
        rounding = rounding_of(count, paths, [(part, i) for _, part, i in found], pieces, signed)
        stored = encode_all(local, fmt, places, mesh, signed, rounding, timeout)
        for (index, part, i), (c, s) in zip(found, stored):
            codes[part][i], scales[part][i] = c, s
            leaves[index] = dtensor_lib.with_empty_dim(leaves[index])
        return codes, scales

    def rounding_of(
        count: Tensor,
        paths: Sequence[str],
        which: Sequence[tuple[int, int]],
        pieces: Sequence[Optional[Piece]],
        signed: Sequence[bool],
    ) -> list[Optional[Rounding]]:
        """Per (local) leaf to store, ``(part, param index)`` in ``which``: what its stochastic
        rounding draws from (a signed field at 4 bits: first moments, momenta; see quantize_state),
        keyed by ``count``, its param's path and part, and its elements' logical indices (from its
        ``piece`` of the logical tensor, ``None`` for the whole of it), or ``None`` (to nearest)."""
        rounding: list[Optional[Rounding]] = [None] * len(which)
        if not fmt.stochastic:
            return rounding
        rounded = [k for k, sign in enumerate(signed) if sign]
        keys = [f"{paths[which[k][1]]}#{which[k][0]}" for k in rounded]
        for k, key in zip(rounded, rounding_keys(seed, count, keys, [pieces[k] for k in rounded])):
            rounding[k] = key
        return rounding

    def stored_leaves(state: QuantizedState) -> tuple[list[Any], Any, list[tuple[int, int, int]]]:
        """The inner state's leaves, its structure, and ``(leaf index, part, param index)`` of each stored leaf."""
        leaves, state_def = tree_lib.flatten(state.inner)
        if not any(code is not None for tree in state.codes for code in tree_lib.leaves(tree)):
            # nothing stored (also: Dynamo takes the structure of a tree of None alone for another)
            return leaves, state_def, []
        params_def = tree_lib.structure(state.codes[0])
        starts = params_parts(state_def, params_def)
        if len(starts) != len(state.codes) or len(state.scales) != len(state.codes):
            raise ValueError(
                f"{owner}: the state holds codes for {len(state.codes)} params-shaped parts and scales for "
                f"{len(state.scales)}, but its inner state has {len(starts)}; it was not made by this transformation"
            )
        found = []
        for part, start in enumerate(starts):
            for i, code in enumerate(tree_lib.leaves(state.codes[part])):
                if code is not None:
                    found.append((start + i, part, i))
        return leaves, state_def, found

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        return run(updates, state, params, inplace, extra_args)

    def scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None):
        """A clip's coefficient handed to the 8-bit Adam step on the codes, taken where its kernel
        reads the gradients; where that route is not taken, the gradients are scaled first."""
        return run(updates, state, params, inplace, {}, (grad_scale, scaling))

    def run(updates, state, params, inplace, extra_args, handed=None):
        check_storage(state)
        leaves, state_def, found = stored_leaves(state)
        count = fe.increment(state.count, inplace=donation(inplace)[1])  # "updates": the state is not donated
        code_leaves = [tree_lib.leaves(tree) for tree in state.codes]
        scale_leaves = [tree_lib.leaves(tree) for tree in state.scales]
        mesh, cuts = layout_of(params if params is not None else updates) if found else (None, [])
        if not extra:
            extra_args = {}
        nonnegative = nonnegative_parts(state_def, tree_lib.structure(state.codes[0])) if found else ()
        paths = [""] * len(code_leaves[0]) if code_leaves else []
        if fmt.stochastic and code_leaves:
            paths = tree_lib.paths(state.codes[0])
        # a piece at a time eagerly; traced, the compiler lays out loops and buffers itself, and each
        # piece's copy into its leaf's new tensors made Inductor's step of a large leaf 10x slower
        eager_plain = found and mesh is None and _plain(updates, params) and not torch.compiler.is_compiling()
        if eager_plain and (direct or elementwise):
            step = Step(
                inner_update if handed is None else functools.partial(inner_scaled, grad_scale=handed[0], scaling=handed[1]),
                updates, params, leaves, state_def, params_parts(state_def, tree_lib.structure(state.codes[0])),
                code_leaves, scale_leaves, [not n for n in nonnegative], fmt, inplace, extra_args, lambda new: same_structure(new, state_def),
            )
            done = update_directly(step) if direct else None
            if done is None and handed is not None:
                updates, inplace, handed = *scaled_first(updates, inplace, handed), None
                step = step._replace(inner_update=inner_update, updates=updates, inplace=inplace)
            if done is None and elementwise:
                done = update_in_groups(step, functools.partial(rounding_of, count, paths))
            if done is not None:
                new_updates, new_leaves, new_codes, new_scales = done
                return new_updates, rebuild(state, new_leaves, state_def, new_codes, new_scales, count)
        if handed is not None:
            updates, inplace = scaled_first(updates, inplace, handed)
        for index, part, i in found:
            if mesh is not None and cuts[i] is None:
                raise ValueError(
                    f"{owner}: the gradient of param {tree_lib.path_at(updates, i)!r} is None, so where its sharded "
                    "state lies is unknown; pass params to update"
                )
            place = place_of(cuts[i], fmt.block_size)
            leaves[index] = decode(code_leaves[part][i], scale_leaves[part][i], leaves[index], fmt, place)
        inner_state = tree_lib.unflatten(state_def, leaves)
        new_updates, new_inner = inner_update(updates, inner_state, params, inplace=inplace, **extra_args)
        new_leaves = same_structure(new_inner, state_def)
        if not found:  # the codes and scales (None) as they were
            return new_updates, QuantizedState(tree_lib.unflatten(state_def, new_leaves), state.codes, state.scales, count, state.stored_as)
        new_codes, new_scales = store(new_leaves, found, nonnegative, paths, mesh, cuts, count)
        return new_updates, rebuild(state, new_leaves, state_def, new_codes, new_scales, count)

    def check_storage(state: Any) -> None:
        """A ``ValueError`` unless ``state`` is stored as this transformation stores (another kind of
        state fails further on, and the state check says what it is)."""
        if not isinstance(state, QuantizedState):
            return
        mark = state.stored_as
        if not isinstance(mark, Tensor) or mark.dim() != 3 or tuple(mark.shape) != expected_mark:
            found = _storage_text(tuple(mark.shape)) if isinstance(mark, Tensor) and mark.dim() == 3 else repr(mark)
            raise examined(ValueError(
                f"{owner}: state.stored_as says its codes were stored as {found}, but this transformation stores "
                f"{_storage_text(expected_mark)}; read with another block size or format they would be other numbers "
                "(load the state into a quantize_state made with the same bits and block_size)"
            ))

    def scaled_first(updates: Any, inplace: Any, handed: tuple[Tensor, Any]) -> tuple[Any, Any]:
        """The updates scaled by a handed coefficient, as the clip would have scaled them, and the
        ``inplace`` to step them with: a scaled copy is the step's own, so it is donated on."""
        own_updates, _ = donation(inplace)
        scaled = fe.scaled_tree(updates, handed[0], handed[1], inplace=own_updates)
        if not own_updates and takes_donated_updates(inner):
            inplace = DONATE_UPDATES
        return scaled, inplace

    def same_structure(new_inner: Any, state_def: Any) -> list[Any]:
        """The leaves of the inner state ``inner.update`` returned, or a ``ValueError`` if its structure is another."""
        new_leaves, new_def = tree_lib.flatten(new_inner)
        if new_def != state_def:
            raise ValueError(f"{owner}: {name_of(inner.update)} returned a state of another structure than it was given")
        return new_leaves

    def rebuild(state: QuantizedState, new_leaves: list[Any], state_def: Any, new_codes: list, new_scales: list, count: Tensor) -> QuantizedState:
        """The new :class:`QuantizedState`: the inner state's leaves, per part the codes and scales, as ``state`` holds them, and ``count``."""
        codes = tuple(tree_lib.unflatten(tree_lib.structure(t), c) for t, c in zip(state.codes, new_codes))
        scales = tuple(tree_lib.unflatten(tree_lib.structure(t), s) for t, s in zip(state.scales, new_scales))
        return QuantizedState(tree_lib.unflatten(state_def, new_leaves), codes, scales, count, state.stored_as)

    runs_inner(update_fn, inner)
    if takes_donated_updates(inner):
        update_fn = supports_donated_updates(update_fn, returns_new_updates=returns_new_updates(inner))
    inner_scaled = scaled_update_of(inner.update)
    if direct and inner_scaled is not None and not extra:  # the 8-bit Adam step takes a clip's coefficient
        update_fn = takes_scaled_gradients(update_fn, scaled_update)
    name = f"quantize_state({name_of(inner.update)})"
    return (GradientTransformationExtraArgs if extra else GradientTransformation)(init_fn, named(update_fn, name))
