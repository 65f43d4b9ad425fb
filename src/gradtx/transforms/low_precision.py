"""Low-precision parameters: updates that land on bfloat16 / float16 params without stalling.

Adding a small update to a bfloat16 parameter and rounding to nearest loses it whenever it is below
half the parameter's spacing (``2**-9`` of its magnitude): training stalls. Two chain members
placed last fix that, and :func:`~gradtx.master_weights` (a wrapper) is the third way:

- :func:`stochastic_rounding` rounds ``p + u`` up or down at random, with the probability that makes
  the result unbiased (``E[SR(x)] = x``), so small updates land on average;
- :func:`kahan_summation` keeps the rounding error of every step and adds it back at the next.

Both emit updates ``u' = new - p`` computed in float32, where ``new`` is the rounded sum in the
param's dtype: the difference of two bfloat16 numbers whose exponents differ by at most 15 (two
float16 ones: 12) is exact in float32, and so is ``p + u'``, so ``apply_updates`` (which adds in
float32 and rounds once) lands exactly on ``new``. ``dtype="param"`` emits the updates in the
param's dtype instead, as a torch optimizer under :func:`~gradtx.wrap` needs its gradients; they
are then exact whenever ``new`` is within a factor of two of ``p`` (Sterbenz's lemma), that is for
every update smaller than half its parameter. Params of float32 or wider pass through untouched.

Stochastic rounding is layout-free: the random bits of an element are a counter-based hash of the
seed, the step count kept in the state, the leaf's path and the element's index in the *logical*
tensor (its row-major position in the whole leaf, found from this rank's piece under a
``ShardingSpec`` or DTensor by :mod:`gradtx.sharding.elements`; a flat ZeRO piece's logical tensor
is the flattened leaf), so a sharded run rounds every element as the dense run does, and a state
saved and loaded rounds the next step as an uninterrupted run would. Kahan summation is
elementwise and so layout-free as it is.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import sharding
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation, takes_spec
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.sharding import elements
from gradtx.transforms import _foreach as fe

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""The param dtypes these transformations round into; wider floating dtypes pass through."""

UpdatesDtype = Union[None, torch.dtype, str]
"""The dtype of the emitted updates of low-precision leaves: ``None`` (float32), float32,
float64, or ``"param"`` (each leaf's own dtype)."""

_MASK = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63 (no int64 overflow,
# so eager, compiled and every backend compute the same bits)
_M1, _M2 = 0x7FEB352D, 0x5BD1E995


# --------------------------------------------------------------------------- checks


def check_updates_dtype(dtype: UpdatesDtype, *, owner: str) -> UpdatesDtype:
    """``dtype`` if it is one the emitted updates may take, else a ``ValueError``."""
    if dtype is None or dtype == "param" or dtype in (torch.float32, torch.float64):
        return dtype
    raise ValueError(f"{owner}: dtype must be None, torch.float32, torch.float64 or 'param', got {dtype!r}")


def low_precision_flags(params: Any, *, owner: str) -> list[bool]:
    """Per param leaf: whether it is bfloat16 / float16 (``False`` for ``None`` and wider floats).
    A leaf that is not floating point, complex, or of another narrow float dtype (float8) is a
    ``TypeError`` naming its path."""
    flags = []
    for index, leaf in enumerate(tree_lib.leaves(params)):
        if leaf is None:
            flags.append(False)
            continue
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{owner}: leaf {tree_lib.path_at(params, index)!r} is a {type(leaf).__name__}, expected a torch.Tensor")
        dtype = leaf.dtype
        if dtype.is_complex:
            tree_lib.refuse_complex(params, owner=owner, why="rounding is defined on real numbers")
        if not dtype.is_floating_point:
            raise TypeError(
                f"{owner}: leaf {tree_lib.path_at(params, index)!r} is {dtype}, not a floating-point parameter; "
                "only bfloat16 and float16 params are rounded (float32 and wider pass through)"
            )
        if dtype not in LOW_PRECISION and torch.finfo(dtype).bits < 32:
            raise TypeError(
                f"{owner}: leaf {tree_lib.path_at(params, index)!r} is {dtype}; only bfloat16 and float16 params "
                "are rounded (float32 and wider pass through)"
            )
        flags.append(dtype in LOW_PRECISION)
    return flags


def check_update(update: Tensor, param: Tensor, *, owner: str, path: str) -> None:
    """A floating-point update, laid out as its param where either is a DTensor (the sum is taken
    on the local pieces: a ``Partial`` update, not reduced yet, would be summed as this rank's share)."""
    if not update.is_floating_point():
        raise TypeError(f"{owner}: leaf {path!r} has a {update.dtype} update; updates must be floating point")
    dtensors = [t for t in (param, update) if dtensor_lib.is_dtensor(t)]
    if dtensors:
        try:
            dtensor_lib.check_one_layout(dtensors)
        except ValueError as exc:
            raise ValueError(f"{owner}: leaf {path!r}: {exc}") from None


# --------------------------------------------------------------------------- rounding


def _wide(update: Tensor) -> torch.dtype:
    return torch.float64 if update.dtype == torch.float64 else torch.float32


def exact_sum(param: Tensor, update: Tensor) -> Tensor:
    """``param + update`` in float32 (from float64 where the update is float64)."""
    wide = _wide(update)
    return (param.to(wide) + update.to(wide)).to(torch.float32)


_FORMATS = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}
"""Per low-precision dtype: its fraction bits and the exponent of its smallest normal number."""


def round_stochastic(x: Tensor, dtype: torch.dtype, draws: Tensor) -> Tensor:
    """Float32 ``x`` rounded into ``dtype`` stochastically, given ``draws``: integers uniform in
    ``[0, 2**24)``.

    ``x`` lies between two neighbours of ``dtype``, ``t`` toward zero and ``t + gap`` away from
    zero; it rounds away with probability ``(|x| - |t|) / gap``. In float32's bits, ``|t|`` is
    ``|x|`` with its ``d`` lowest bits cleared (``d = 16`` for bfloat16, 13 for float16's normal
    numbers, more for its subnormals) and ``gap`` is one unit of bit ``d``; the cleared bits ``r``
    decide: away iff ``r * 2**24 > draw * 2**d``, an integer comparison that rounds away with
    probability exactly ``r / 2**d``. So the rounding is exactly unbiased, computed with integer
    ops only (which no compiler reassociates). Float16 values below its smallest subnormal ``s``
    round to ``s`` with probability ``|x| / s`` on the ``2**-24`` grid of the draws. Values beyond
    the largest finite one may round to infinity, as rounding to nearest does; NaN stays NaN.
    """
    fraction_bits, min_exponent = _FORMATS[dtype]
    bits = x.view(torch.int32).to(torch.int64)
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23
    spacing = torch.clamp(exponent - 127, min=min_exponent) - fraction_bits  # log2 of dtype's gap at x
    cleared = spacing - (torch.clamp(exponent, min=1) - 150)  # float32's gap at x is 2**(that - 150)
    tiny = cleared > 23  # float16 below its smallest subnormal: no bits of |x| to clear
    cleared = torch.clamp(cleared, max=23)
    unit = torch.bitwise_left_shift(torch.ones_like(cleared), cleared)
    rest = magnitude & (unit - 1)
    toward = magnitude - rest
    away = (torch.bitwise_left_shift(rest, 24) > torch.bitwise_left_shift(draws, cleared)) & ~tiny
    smallest = (min_exponent - fraction_bits + 127) << 23  # float16's smallest subnormal, a float32 normal
    scaled = (magnitude & 0x7FFFFFFF).to(torch.int32).view(torch.float32) * float(2.0 ** (fraction_bits - min_exponent))
    away_tiny = tiny & (scaled > draws.to(torch.float32) * (2.0**-24))
    chosen = torch.where(away, toward + unit, torch.where(away_tiny, torch.full_like(toward, smallest), torch.where(tiny, 0, toward)))
    value = chosen.to(torch.int32).view(torch.float32)
    rounded = torch.where(bits < 0, -value, value)
    return torch.where(x.isnan(), x, rounded).to(dtype)


def updates_to(new: Tensor, param: Tensor, dtype: UpdatesDtype) -> Tensor:
    """``new - param`` in the dtype the updates are emitted in (see the module's docstring); 0
    where ``new`` is ``param`` itself, so that an infinite param stays as it is (``inf - inf``
    would be NaN, and ``p + NaN`` NaN)."""
    out = param.dtype if dtype == "param" else (dtype or torch.float32)
    return torch.where(new == param, 0.0, new.to(out) - param.to(out))


# --------------------------------------------------------------------------- random bits


def _mix(x: Tensor) -> Tensor:
    """A bijective mix of 32-bit values held in int64 (xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def path_key(path: str) -> tuple[int, int]:
    """A leaf path's 64-bit FNV-1a hash as two 32-bit words: the same in every process, and plain
    integer arithmetic that ``torch.compile`` folds into constants."""
    value = 0xCBF29CE484222325
    for byte in path.encode():
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value & _MASK, value >> 32


def stream_key(seed: Tensor, count: Tensor) -> Tensor:
    """The hash of (seed, step count) every leaf's draws of one step start from (0-d int64)."""
    key = _mix((seed & _MASK) ^ 0x243F6A88)
    key = _mix(key ^ ((seed >> 32) & _MASK))
    return _mix(key ^ (count.to(torch.int64) & _MASK))


def leaf_keys(stream: Tensor, paths: Sequence[str]) -> Tensor:
    """Per leaf path, its key of one step: the stream key mixed with the path's hash (int64, one
    per path)."""
    words = torch.tensor([path_key(path) for path in paths], dtype=torch.int64, device=stream.device).view(-1, 2)
    return _mix(_mix(stream ^ words[:, 0]) ^ words[:, 1])


def element_draws(key: Tensor, index: Tensor) -> Tensor:
    """Integers uniform in ``[0, 2**24)`` (int64), one per element: a hash of its leaf's key and
    its logical index (``key`` broadcasts against ``index``)."""
    bits = _mix(key.to(index.device) ^ (index & _MASK))
    bits = _mix(bits ^ (index >> 32))
    bits = _mix((bits + 0x9E3779B9) & _MASK)
    return bits >> 8


def quick_draws(key: Tensor, index: Tensor) -> Tensor:
    """:func:`element_draws` with one mixing round instead of three (a third of the cost): integers
    uniform in ``[0, 2**24)`` (int64), one per element, a bijective mix of its leaf's key and its
    logical index. The draws of one element at two steps (two keys from :func:`leaf_keys`) are as
    uncorrelated as random ones, which is what rounding a state afresh each step needs."""
    return _mix((key.to(index.device) ^ index ^ (index >> 32)) & _MASK) >> 8


def random_draws(seed: Tensor, count: Tensor, path: str, index: Tensor) -> Tensor:
    """Integers uniform in ``[0, 2**24)`` (int64), one per element of ``index``: a hash of (seed, step
    count, leaf path, logical element index), so they do not depend on how the leaf is laid out
    across ranks."""
    return element_draws(leaf_keys(stream_key(seed, count), [path])[0], index)


# --------------------------------------------------------------------------- stochastic rounding


BUCKET_ELEMENTS = 1 << 22
"""Stochastic rounding hashes and rounds the leaves of one dtype together in buckets of at most so
many elements (a larger leaf alone): the kernels run once per bucket rather than once per leaf, and
its int64 temporaries stay within a few times 32 MiB whatever the model's size."""


def _buckets(groups: dict[tuple[Any, ...], list[int]], sizes: Sequence[int]) -> list[tuple[tuple[Any, ...], list[int]]]:
    """Each group's members (in order) cut into runs of at most :data:`BUCKET_ELEMENTS` elements."""
    out: list[tuple[tuple[Any, ...], list[int]]] = []
    for key, members in groups.items():
        bucket: list[int] = []
        total = 0
        for k in members:
            if bucket and total + sizes[k] > BUCKET_ELEMENTS:
                out.append((key, bucket))
                bucket, total = [], 0
            bucket.append(k)
            total += sizes[k]
        out.append((key, bucket))
    return out


def _rewrapped(param: Tensor, local_update: Tensor) -> Tensor:
    """A local update laid out as its param (a DTensor param's update is a DTensor like it)."""
    if not dtensor_lib.is_dtensor(param):
        return local_update
    return dtensor_lib.locals_of([param])[1]([local_update])[0]


class StochasticRoundingState(NamedTuple):
    """``count``: steps so far (0-d int32, part of every random draw); ``seed``: the seed (0-d int64)."""

    count: Tensor
    seed: Tensor


@takes_spec
def stochastic_rounding(
    seed: int = 0, *, dtype: UpdatesDtype = None, spec: Optional[sharding.ShardingSpec] = None
) -> GradientTransformation:
    """Rounds every new bfloat16 / float16 parameter ``p + u`` stochastically (unbiased) into the
    param's dtype; place it last in a chain (after the learning rate).

    Emits ``u' = SR(p + u) - p`` in float32, so ``apply_updates`` lands exactly on ``SR(p + u)``
    (see :mod:`gradtx.transforms.low_precision`). Params of float32 or wider pass through. The
    sum ``p + u`` is taken in float32 and rounded up or down with the probability that makes its
    expectation exact; the random bits hash (``seed``, step count, leaf path, logical element
    index), so they are the same under any sharding and after a checkpoint is loaded.

    Args:
      seed: an integer seed.
      dtype: the dtype of the emitted updates of low-precision leaves: ``None`` (float32) or
        float64; ``"param"``, each param's own dtype, for :func:`~gradtx.wrap`, whose torch
        optimizer takes gradients in its params' dtype (exact whenever ``SR(p + u)`` is within a
        factor of two of ``p``).
      spec: how plain params are sharded (a :class:`~gradtx.sharding.ShardingSpec`), to find each
        piece's place in its logical tensor (:mod:`gradtx.sharding.elements`); DTensor params
        describe themselves. A plain piece split along a dim names it (``Shard("tp", dim=1)``),
        and may be uneven; a flat ZeRO piece (``Shard("dp")``, no dim) is a 1-D run of the
        flattened leaf. The pieces' sizes are exchanged once per layout (one ``all_gather_object``).

    Leaves of one param dtype are hashed and rounded together (one concatenated tensor), so a
    step costs a few kernels per dtype rather than per leaf.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"stochastic_rounding: seed must be an int, got {type(seed).__name__} {seed!r}")
    dtype = check_updates_dtype(dtype, owner="stochastic_rounding")
    seed_value = int(seed)

    def init_fn(params: Any) -> StochasticRoundingState:
        low_precision_flags(params, owner="stochastic_rounding")
        count = fe.zero_count(params)
        return StochasticRoundingState(count=count, seed=torch.tensor(seed_value, dtype=torch.int64, device=count.device))

    def update_fn(updates, state, params=None, *, inplace=False):
        tree_lib.require_params(updates, params, owner="stochastic_rounding", why=" (it rounds p + u)")
        leaves = fe.leaves_of(updates, what="stochastic_rounding")
        count = fe.increment(state.count, inplace=inplace)
        seed = state.seed if inplace else state.seed.clone()  # a pure step's state is new tensors
        if not leaves.present:
            return updates, StochasticRoundingState(count=count, seed=seed)
        param_values = fe.params_of(leaves, params, owner="stochastic_rounding")
        flags = low_precision_flags(params, owner="stochastic_rounding")
        out = list(leaves.tensors)
        rounded = [k for k, i in enumerate(leaves.present) if flags[i]]
        if not rounded:
            return updates, StochasticRoundingState(count=count, seed=seed)
        paths = tree_lib.paths(params)
        for k in rounded:
            check_update(leaves.tensors[k], param_values[k], owner="stochastic_rounding", path=paths[leaves.present[k]])
        pieces: list[Any] = [None] * len(flags)
        if sharding.is_sharded(tree_lib.leaves(params), spec):
            pieces = elements.element_pieces(params, spec, what="stochastic_rounding")
        stream = stream_key(state.seed, count)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for k in rounded:  # one hash and one rounding per (param dtype, sum dtype, device) bucket
            p, u = param_values[k], leaves.tensors[k]
            groups.setdefault((p.dtype, _wide(u), p.device), []).append(k)
        for (param_dtype, wide, device), members in _buckets(groups, [dtensor_lib.local(p).numel() for p in param_values]):
            p_locals = [dtensor_lib.local(param_values[k]) for k in members]
            u_locals = [dtensor_lib.local(leaves.tensors[k]) for k in members]
            sizes = [p.numel() for p in p_locals]
            total = sum(sizes)
            flat_p = torch.cat([p.reshape(-1) for p in p_locals])
            flat_u = torch.cat([u.reshape(-1).to(wide) for u in u_locals])
            x = (flat_p.to(wide) + flat_u).to(torch.float32)
            keys = leaf_keys(stream, [paths[leaves.present[k]] for k in members])
            counts = torch.tensor(sizes, dtype=torch.int64, device=device)
            if all(pieces[leaves.present[k]] is None for k in members):  # whole leaves: aranges restarting per leaf
                starts = torch.tensor([0] + sizes[:-1], dtype=torch.int64, device=device).cumsum(0)
                index = torch.arange(total, dtype=torch.int64, device=device) - starts.repeat_interleave(counts, output_size=total)
            else:
                index = torch.cat(
                    [elements.logical_indices(pieces[leaves.present[k]], p.shape, device).reshape(-1) for k, p in zip(members, p_locals)]
                )
            draws = element_draws(keys.repeat_interleave(counts, output_size=total), index)
            new = round_stochastic(x, param_dtype, draws)
            emitted = updates_to(new, flat_p, dtype)
            for k, p, piece in zip(members, p_locals, emitted.split(sizes)):
                out[k] = _rewrapped(param_values[k], piece.view(p.shape))
        return leaves.rebuild(out), StochasticRoundingState(count=count, seed=seed)

    return GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- Kahan summation


class KahanSummationState(NamedTuple):
    """``compensation``: per low-precision param, what its last roundings lost (float32, the param's
    shape); ``None`` for the other leaves."""

    compensation: Any


def kahan_summation(*, dtype: UpdatesDtype = None) -> GradientTransformation:
    """Compensated (Kahan) summation of the updates into bfloat16 / float16 params; place it last in a
    chain (after the learning rate).

    With ``y = u + c`` (``c`` the compensation), it emits ``u' = round(p + y) - p`` (in float32, so
    ``apply_updates`` lands exactly on ``round(p + y)``, the sum rounded to nearest in the param's
    dtype) and keeps ``c = y - u'``, the part of ``y`` the rounding lost, for the next step. Params
    of float32 or wider pass through.

    The compensation is kept in float32. Kept in bfloat16 it would hold the lost part of each
    step to 8 bits only: an update of ``2**-13`` of its parameter loses up to a sixteenth of itself
    at every step as the compensation nears half the parameter's spacing (1000 updates of ``1e-4``
    to a bfloat16 ``1.0`` end 2.8% away from the float32 sum), where float32 keeps ``p + c`` exact
    to about ``2**-24`` of the sum. It costs the memory of a float32 master copy
    (:func:`~gradtx.master_weights`), without changing what the transformations before it see.

    Args:
      dtype: the dtype of the emitted updates, as for :func:`stochastic_rounding`.
    """
    dtype = check_updates_dtype(dtype, owner="kahan_summation")

    def init_fn(params: Any) -> KahanSummationState:
        flags = low_precision_flags(params, owner="kahan_summation")
        all_leaves, treedef = tree_lib.flatten(params)
        zeros = [torch.zeros_like(p, dtype=torch.float32) if flag else None for p, flag in zip(all_leaves, flags)]
        return KahanSummationState(compensation=tree_lib.unflatten(treedef, zeros))

    def update_fn(updates, state, params=None, *, inplace=False):
        del inplace
        tree_lib.require_params(updates, params, owner="kahan_summation", why=" (it rounds p + u)")
        leaves = fe.leaves_of(updates, what="kahan_summation")
        if not leaves.present:
            return updates, state
        param_values = fe.params_of(leaves, params, owner="kahan_summation")
        flags = low_precision_flags(params, owner="kahan_summation")
        compensation = tree_lib.flatten_like(
            state.compensation, leaves.treedef, leaves.tree, what="kahan_summation: state.compensation", like="updates"
        )
        new_compensation = list(compensation)
        out = []
        for i, p, u in zip(leaves.present, param_values, leaves.tensors):
            if not flags[i]:
                out.append(u)
                continue
            c = compensation[i]
            path = tree_lib.path_at(params, i)
            check_update(u, p, owner="kahan_summation", path=path)
            if not isinstance(c, Tensor) or c.shape != p.shape:
                raise ValueError(f"kahan_summation: leaf {path!r} has no compensation of its shape in the state")
            (p_local, u_local, c_local), rewrap = dtensor_lib.locals_of([p, u, c])
            y = exact_sum(c_local, u_local)
            new = exact_sum(p_local, y).to(p.dtype)
            exact = updates_to(new, p_local, torch.float32)
            emitted = exact if dtype is None or dtype == torch.float32 else updates_to(new, p_local, dtype)
            _, wrapped_update, wrapped_c = rewrap([p_local, emitted, (y - exact).to(c.dtype)])
            out.append(wrapped_update)
            new_compensation[i] = wrapped_c
        state = KahanSummationState(compensation=tree_lib.unflatten(leaves.treedef, new_compensation))
        return leaves.rebuild(out), state

    return GradientTransformation(init_fn, update_fn)
