"""The machinery shared by the stateful transforms: aligned leaves, groups, and foreach arithmetic.

A transform's ``update`` flattens the updates, lines up the matching leaves of its state (and of
the params) with the non-``None`` updates, and runs its arithmetic once per group of leaves that
share devices and dtypes, on ``torch._foreach_*`` kernels.

Every op here takes ``inplace``: ``False`` returns new tensors and leaves its inputs alone, ``True``
overwrites the first list and returns it. A transform runs the *same* op sequence on both paths
(the first op on a donated buffer runs in place, on the pure path it allocates and every later op
runs in place on what it allocated), so both paths give bit-identical numbers. Where a graph must
be recorded (autograd on a tensor that requires grad, a tensor hyperparameter included, or a
``torch.func`` transform) every op returns new tensors from ordinary per-tensor ops instead, and
the result is differentiable; transforms therefore always use what an op returns.

Step-dependent factors (bias corrections, scheduled learning rates) are 0-d tensors computed with
tensor ops, never read on the host: no device sync, no recompilation under ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from gradtx import packing, torch_internals
from gradtx import tree as tree_lib
from gradtx.sharding.dtensor import dtensor_type

Scalar = Union[float, Tensor]


# --------------------------------------------------------------------------- leaves


class Leaves(NamedTuple):
    """The non-``None`` leaves of an updates tree and how to put a tree back together."""

    tree: Any
    all_leaves: list[Any]
    treedef: Any
    present: list[int]
    tensors: list[Tensor]

    def aligned(self, other: Any, *, what: str) -> list[Any]:
        """The leaves of ``other`` (a tree shaped like the updates) at the non-``None`` updates."""
        other_leaves = tree_lib.flatten_like(other, self.treedef, self.tree, what=what, like="updates")
        if len(self.present) == len(other_leaves):  # every update present (no per-leaf step to trace)
            out = list(other_leaves)
        else:
            out = [other_leaves[i] for i in self.present]
        if False not in tree_lib.instances(out, Tensor):
            return out
        for i, leaf in zip(self.present, out):
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{what}: leaf {tree_lib.path_at(self.tree, i)!r} has an update but its value is "
                    f"{type(leaf).__name__}, expected a torch.Tensor"
                )
        return out

    def rebuild(self, values: Sequence[Any], like: Optional[Any] = None) -> Any:
        """A tree shaped like the updates with ``values`` at the non-``None`` leaves.

        The other leaves come from ``like`` (a state tree, kept as it was) or stay ``None``.
        """
        if like is None or len(self.present) == len(self.all_leaves):  # nothing of ``like`` is kept
            base = self.all_leaves
        else:
            base = tree_lib.flatten_like(like, self.treedef, self.tree, what="state", like="updates")
        return tree_lib.unflatten(self.treedef, tree_lib.replace_present(base, self.present, values))


# True while ``inject_hyperparams`` builds and runs its inner transformation in a traced step: its
# numeric arguments are then symbolic (Dynamo's scalars of the state's tensors), which no Python
# branch may test. Set and read only while compiling.
_SYMBOLIC_HYPERPARAMS = [False]


def symbolic_hyperparams() -> bool:
    """Whether a factory's numbers may be symbolic here (see ``_SYMBOLIC_HYPERPARAMS``): a check of
    their values is then left to the eager call that built the same transformation first."""
    return torch.compiler.is_compiling() and _SYMBOLIC_HYPERPARAMS[0]


def known_zero(value: Any) -> bool:
    """Whether ``value`` is a number known to be 0 (an op it scales or adds may be skipped): not
    a tensor, and not a symbolic hyperparameter (where the op is kept, with the same numbers)."""
    return isinstance(value, (int, float)) and not symbolic_hyperparams() and value == 0


def leaves_of(updates: Any, *, what: str) -> Leaves:
    """Flattens ``updates`` and checks that every leaf is a tensor or ``None``."""
    all_leaves, treedef, present = tree_lib.tensor_leaves(updates, what=what)
    tensors = list(all_leaves) if len(present) == len(all_leaves) else [all_leaves[i] for i in present]
    return Leaves(updates, all_leaves, treedef, present, tensors)


def params_of(leaves: Leaves, params: Any, *, owner: str) -> list[Tensor]:
    """The parameters matching the non-``None`` updates; ``params`` are required."""
    tree_lib.require_params(leaves.tree, params, owner=owner)
    if not leaves.present:  # nothing selected (see require_params): no params needed
        return []
    values = leaves.aligned(params, what=f"{owner}: params")
    for i, p, u in zip(leaves.present, values, leaves.tensors):
        if p.shape != u.shape:
            raise ValueError(
                f"{owner}: leaf {tree_lib.path_at(leaves.tree, i)!r} has update shape {tuple(u.shape)} "
                f"but parameter shape {tuple(p.shape)}"
            )
    return values


def zeros_like_tree(params: Any, dtype: Optional[torch.dtype] = None) -> Any:
    """A tree of zeros shaped like ``params`` (``None`` stays ``None``), optionally in ``dtype`` (for
    a complex leaf, a real ``dtype`` is a precision: :func:`gradtx.tree.state_dtype`)."""
    if dtype is None:
        return tree_lib.tree_map(torch.zeros_like, params)
    all_leaves, treedef = tree_lib.flatten(params)
    zeros = [
        None if p is None else torch.zeros_like(p, dtype=tree_lib.state_dtype(dtype, p, where=tree_lib.path_at(params, i)))
        for i, p in enumerate(all_leaves)
    ]
    return tree_lib.unflatten(treedef, zeros)


def full_like_tree(params: Any, value: float) -> Any:
    return tree_lib.tree_map(lambda p: torch.full_like(p, value), params)


def zero_count(params: Any) -> Tensor:
    """A step counter: a 0-d int32 tensor, as optax's."""
    return torch.zeros((), dtype=torch.int32, device=tree_lib.first_device(params))


def increment(count: Tensor, *, inplace: bool) -> Tensor:
    """``count + 1``, saturating at the dtype's maximum (optax's ``safe_increment``), with tensor ops
    (out of place under ``torch.func``, where a counter may be a batched view that cannot be written)."""
    step = (count < torch.iinfo(count.dtype).max).to(count.dtype) if not count.is_floating_point() else 1
    return count.add_(step) if inplace and not tree_lib.needs_graph(count) else count + step


def decay_power(decay: float, count: Tensor) -> Tensor:
    """``decay ** count`` as a 0-d float64 tensor on ``count``'s device."""
    return torch.pow(decay, count.to(torch.float64))


def as_scalar_tensor(value: Any, like: Tensor) -> Tensor:
    """A schedule's value (a number or a 0-d tensor) as a 0-d float64 tensor next to ``like``
    (a number is filled in on the device, not copied from the host)."""
    if isinstance(value, Tensor):
        return value.to(device=like.device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=like.device)


def number_or_tensor(value: Any) -> Union[float, Tensor]:
    """A hyperparameter as given: a 0-d tensor stays one (``inject_hyperparams`` passes them; reading
    it on the host would sync and make ``torch.compile`` specialise on its value), else a float."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"expected a number or a one-element tensor, got shape {tuple(value.shape)}")
        return value.reshape(())
    return float(value)


def schedule_value(schedule: Callable[[Tensor], Any], count: Tensor) -> Tensor:
    """A schedule's value at ``count`` as a 0-d float64 tensor (computed once per compiled step)."""
    return realized(as_scalar_tensor(schedule(count), count))[0]


def realized(*scalars: Any) -> tuple[Any, ...]:
    """The per-step 0-d factors of an update, computed once per step under ``torch.compile``.

    Inductor inlines a scalar expression into every loop that reads it, so a factor such as
    ``1 - b2 ** count``, or a cosine schedule's value, would be re-evaluated (in float64) for
    every vector of every leaf: the compiled clip + AdamW step ran 2.8x slower for it. Stacking the
    factors makes them one small buffer that the loops load from. The 0-d tensors that share the
    first one's dtype and device are stacked; anything else (numbers, ``None``, other tensors)
    passes through, and so does everything in eager mode, where each factor is a small kernel anyway.
    """
    if not torch.compiler.is_compiling():
        return scalars
    first = next((s for s in scalars if isinstance(s, Tensor) and s.dim() == 0), None)
    chosen = [
        i for i, s in enumerate(scalars)
        if isinstance(s, Tensor) and s.dim() == 0 and s.dtype == first.dtype and s.device == first.device
    ] if first is not None else []
    if not chosen:
        return scalars
    stacked = [scalars[i] for i in chosen]
    if len(stacked) == 1:  # Inductor folds a one-input stack away; a second entry keeps it a buffer
        stacked.append(torch.zeros_like(stacked[0]))
    values = torch.stack(stacked).unbind(0)
    result = list(scalars)
    for i, value in zip(chosen, values):
        result[i] = value
    return tuple(result)


# --------------------------------------------------------------------------- groups


def map_groups(
    fn: Callable[..., Sequence[Sequence[Any]]], *lists: Sequence[Any], outputs: int, pack: bool = False
) -> tuple[list[Any], ...]:
    """Runs ``fn`` on each group of positions whose tensors share (device, dtype, DTensor or not) in every list.

    Lists may also hold non-tensors (per-leaf flags), which do not affect the grouping.
    ``fn(*group_lists)`` returns ``outputs`` lists (one entry per tensor of the group); they are put
    back in input order.

    ``pack=True`` says that ``fn`` is elementwise and returns new tensors only (a pure step): many
    small tensors of a group then take it packed into one (:mod:`gradtx.packing`), with
    the same numbers. Never while compiling or where a graph is recorded.
    """
    n = len(lists[0])
    if pack and packing.wanted(lists):
        original = fn
        fn = lambda *group: packing.map_packed(original, group, outputs)  # noqa: E731
    if n and _one_group(lists):
        return tuple(list(values) for values in list(fn(*(list(seq) for seq in lists)))[:outputs])
    groups: dict[tuple, list[int]] = {}
    dtensor = dtensor_type()  # DTensors and plain tensors never share a foreach kernel
    for index in range(n):
        key = tuple(
            (seq[index].device, seq[index].dtype, dtensor is not None and isinstance(seq[index], dtensor))
            for seq in lists
            if isinstance(seq[index], Tensor)
        )
        groups.setdefault(key, []).append(index)
    results: tuple[list[Any], ...] = tuple([None] * n for _ in range(outputs))
    for indices in groups.values():
        for out, values in zip(results, fn(*([seq[i] for i in indices] for seq in lists))):
            for i, value in zip(indices, values):
                out[i] = value
    return results


def _one_group(lists: Sequence[Sequence[Any]]) -> bool:
    """Whether all the positions form one group: in each list, the tensors share one device and
    dtype and are all DTensors or none (lists without tensors, per-leaf flags, do not count).
    Checked a list at a time in C (``map``): on many small tensors a Python loop over the positions
    costs more than the foreach kernels themselves, and for Dynamo to trace."""
    dtensor = dtensor_type()
    for seq in lists:
        classes = list(map(type, seq))  # one kind compared as a list: Dynamo builds a set value by value
        kinds = {classes[0]} if classes and classes == [classes[0]] * len(classes) else set(classes)
        tensors = [issubclass(kind, Tensor) for kind in kinds]
        if not any(tensors):
            continue  # per-leaf flags, or no values
        if not all(tensors) or len({dtensor is not None and issubclass(kind, dtensor) for kind in kinds}) != 1:
            return False
        if not torch_internals.one_device_and_dtype(seq):
            return False
    return True


def on(value: Scalar, tensors: Sequence[Tensor]) -> Scalar:
    """A 0-d tensor factor moved to the group's device and dtype (numbers pass through)."""
    if isinstance(value, Tensor):
        first = tensors[0]
        if value.device != first.device or value.dtype != first.dtype:
            return value.to(device=first.device, dtype=first.dtype)
    return value


def cast(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """``tensors`` in ``dtype`` (the same objects when they already are)."""
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


# --------------------------------------------------------------------------- foreach ops


def scaled(tensors: list[Tensor], factor: Tensor, scaling: Any, *, inplace: bool) -> list[Tensor]:
    """``tensors * factor`` as a global-norm clip scales them: by ``scaling`` (a
    :data:`~gradtx.base.Scaling`) when given, else ``tree.scale_``. For a transformation handed the
    clip's coefficient (:func:`~gradtx.base.takes_scaled_gradients`) where its kernel does not take it."""
    if scaling is not None:
        return scaling(tensors, factor, inplace)
    return tree_lib.scale_(tensors, factor, inplace=inplace)


def scaled_tree(updates: Any, factor: Tensor, scaling: Any, *, inplace: bool) -> Any:
    """The tree ``updates`` with its tensor leaves scaled by :func:`scaled` (in place when
    ``inplace``: the updates are donated): a clip's scaling, where the coefficient handed to a
    transformation cannot be taken by its kernel for the whole tree."""
    tree_leaves, treedef, present = tree_lib.tensor_leaves(updates, what="scaled gradients")
    new = scaled([tree_leaves[i] for i in present], factor, scaling, inplace=inplace)
    return tree_lib.unflatten(treedef, tree_lib.replace_present(tree_leaves, present, new))


def lerp(selves: Sequence[Tensor], ends: Sequence[Tensor], weight: Scalar, *, inplace: bool) -> list[Tensor]:
    """``selves + weight * (ends - selves)``: an exponential moving average step."""
    if isinstance(weight, Tensor):
        weight = [on(weight, selves)] * len(selves)
    return tree_lib.foreach("lerp", selves, ends, weight, inplace=inplace)


def mul(selves: Sequence[Tensor], other: Any, *, inplace: bool) -> list[Tensor]:
    """``selves * other``; ``other`` a number, a 0-d tensor, or a list of tensors."""
    return tree_lib.foreach("mul", selves, other, inplace=inplace)


def div(selves: Sequence[Tensor], other: Any, *, inplace: bool) -> list[Tensor]:
    return tree_lib.foreach("div", selves, other, inplace=inplace)


def add(selves: Sequence[Tensor], other: Any, *, alpha: Scalar = 1.0, inplace: bool) -> list[Tensor]:
    """``selves + alpha * other``; ``other`` a list of tensors, a number or a 0-d tensor."""
    if isinstance(alpha, Tensor):  # a tensor factor needs its own product
        return tree_lib.foreach("add", selves, mul(other, on(alpha, selves), inplace=False), inplace=inplace)
    if isinstance(other, (list, tuple)) or (isinstance(other, Tensor) and alpha != 1.0):
        return tree_lib.foreach("add", selves, other, inplace=inplace, alpha=alpha)
    if isinstance(other, Tensor) and torch.compiler.is_compiling():
        # Inductor lowers the 0-d tensor overload with ``.item()`` (a host sync on an accelerator);
        # the same sum as one broadcast operand per tensor fuses with its neighbours.
        return tree_lib.foreach("add", selves, [other] * len(selves), inplace=inplace)
    return tree_lib.foreach("add", selves, other, inplace=inplace)


def addcmul(selves: Sequence[Tensor], t1: Sequence[Tensor], t2: Sequence[Tensor], value: Scalar, *, inplace: bool) -> list[Tensor]:
    """``selves + value * t1 * t2``."""
    if isinstance(value, Tensor):  # a tensor factor needs its own product
        return tree_lib.foreach("addcmul", selves, mul(t1, on(value, selves), inplace=False), t2, inplace=inplace)
    return tree_lib.foreach("addcmul", selves, t1, t2, inplace=inplace, value=value)


def abs_sq(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``|t|^2`` of complex tensors as new real tensors: ``re^2 + im^2``, optax's ``abs_sq``."""
    return [torch.view_as_real(t).square().sum(-1) for t in tensors]


def squares(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``|t|^2`` in new tensors of the dtype of ``tensors`` (``t * t``, or the squared modulus)."""
    if tensors[0].is_complex():
        return [s.to(t.dtype) for s, t in zip(abs_sq(tensors), tensors)]
    return mul(tensors, tensors, inplace=False)


def add_squares(acc: Sequence[Tensor], tensors: Sequence[Tensor], value: Scalar, *, inplace: bool) -> list[Tensor]:
    """``acc + value * |t|^2``: the square of a complex entry is its squared modulus, a real number
    (optax's second moments; a complex ``acc`` keeps a zero imaginary part)."""
    if tensors[0].is_complex():
        return add(acc, abs_sq(tensors), alpha=value, inplace=inplace)
    return addcmul(acc, tensors, tensors, value, inplace=inplace)


def sqrt(selves: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    return tree_lib.foreach("sqrt", selves, inplace=inplace)


def reciprocal(selves: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    return tree_lib.foreach("reciprocal", selves, inplace=inplace)


def abs(selves: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:  # noqa: A001 - mirrors torch
    """``|x|`` in the dtype of ``selves``: the modulus of a complex entry, with a zero imaginary part."""
    if selves[0].is_complex():
        return _real_valued([torch.abs(s) for s in selves], selves, inplace=inplace)
    return tree_lib.foreach("abs", selves, inplace=inplace)


def sign(selves: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    """``sign(x)``; ``x / |x|`` (0 at 0) for a complex entry, as ``numpy.sign`` and JAX's ``sign``."""
    if selves[0].is_complex():
        if inplace and not tree_lib.needs_graph(list(selves)):
            return [s.sgn_() for s in selves]
        return [torch.sgn(s) for s in selves]
    return tree_lib.foreach("sign", selves, inplace=inplace)


def _real_valued(values: Sequence[Tensor], like: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    """Real ``values`` in the complex dtype of ``like`` (zero imaginary parts), written into ``like``
    when ``inplace``."""
    if inplace and not tree_lib.needs_graph(list(like), list(values)):
        return [t.copy_(v) for t, v in zip(like, values)]
    return [v.to(t.dtype) for t, v in zip(like, values)]


def clamp_min(selves: Sequence[Tensor], low: float, *, inplace: bool) -> list[Tensor]:
    """``max(x, low)``; on complex tensors holding real values (second moments), on their real parts."""
    if selves[0].is_complex():
        return _real_valued([torch.clamp_min(s.real, low) for s in selves], selves, inplace=inplace)
    return tree_lib.foreach("clamp_min", selves, low, inplace=inplace)


def clamp_max(selves: Sequence[Tensor], high: float, *, inplace: bool) -> list[Tensor]:
    return tree_lib.foreach("clamp_max", selves, high, inplace=inplace)


def tanh(selves: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    return tree_lib.foreach("tanh", selves, inplace=inplace)


def zero(selves: Sequence[Tensor]) -> list[Tensor]:
    """Zeroes donated buffers in place (new zeros where a graph is recorded)."""
    selves = list(selves)
    if tree_lib.needs_graph(selves):
        return [torch.zeros_like(s) for s in selves]
    torch_internals.foreach_kernel("zero_")(selves)
    return selves


def maximum(selves: Sequence[Tensor], others: Sequence[Tensor], *, inplace: bool) -> list[Tensor]:
    """Elementwise ``max(selves, others)``; on complex tensors holding real values (moments), on
    their real parts (the imaginary parts stay zero)."""
    selves, others = list(selves), list(others)
    if selves[0].is_complex():
        values = [torch.maximum(s.real, o.real if o.is_complex() else o) for s, o in zip(selves, others)]
        return _real_valued(values, selves, inplace=inplace)
    if tree_lib.needs_graph(selves, others):
        return [torch.maximum(s, o) for s, o in zip(selves, others)]
    if inplace:
        torch_internals.foreach_kernel("maximum_")(selves, others)
        return selves
    return list(torch_internals.foreach_kernel("maximum")(selves, others))


def copy_into(buffers: Sequence[Tensor], sources: Sequence[Tensor]) -> list[Tensor]:
    """Overwrites donated ``buffers`` with ``sources`` (converting dtypes) and returns them; where a
    graph is recorded, returns ``sources`` in the buffers' dtypes and devices instead."""
    buffers, sources = list(buffers), list(sources)
    if tree_lib.needs_graph(buffers, sources):
        return [s.to(device=b.device, dtype=b.dtype) for b, s in zip(buffers, sources)]
    if buffers and isinstance(buffers[0], dtensor_type() or ()):  # DTensor has no foreach copy
        for b, s in zip(buffers, sources):
            b.copy_(s)
        return buffers
    torch_internals.foreach_kernel("copy_")(buffers, sources)
    return buffers


def _same_dtypes(buffers: Sequence[Tensor], sources: Sequence[Tensor]) -> bool:
    return all(b.dtype == s.dtype for b, s in zip(buffers, sources))


def fresh(sources: Sequence[Tensor], *, into: Optional[Sequence[Tensor]]) -> list[Tensor]:
    """Working buffers holding ``sources``: the donated ``into`` overwritten where it has their
    dtypes (a buffer of another dtype would round them: bfloat16 gradients donated beside float32
    moments), else new clones."""
    if into is not None and _same_dtypes(into, sources):
        return copy_into(into, sources)
    return [s.clone() for s in sources]


def _writes_out(*lists: Sequence[Tensor]) -> bool:
    """Whether per-tensor ``out=`` kernels serve better than foreach ones: on the CPU, where foreach
    kernels are a loop over the same per-tensor kernels anyway, ``out=`` saves a pass over memory
    (never where a graph is recorded: ``out=`` kernels are not differentiable)."""
    return lists[0][0].device.type == "cpu" and not tree_lib.needs_graph(*(list(x) for x in lists))


def _out_traceable(outs: Sequence[Tensor]) -> bool:
    """Whether an ``out=`` kernel into each of ``outs`` can be traced: Dynamo traces one only into
    a contiguous tensor (a permuted buffer, from a permuted parameter, is written by ``copy_``)."""
    return not torch.compiler.is_compiling() or all(out.is_contiguous() for out in outs)


def sqrt_of(sources: Sequence[Tensor], *, into: Optional[Sequence[Tensor]]) -> list[Tensor]:
    """``sqrt(sources)`` written into the donated ``into`` where it has their dtypes, or into new
    tensors (same numbers)."""
    if into is None or not _same_dtypes(into, sources):
        return sqrt(sources, inplace=False)
    into = list(into)
    if _writes_out(into, sources) and _out_traceable(into):
        return [torch.sqrt(s, out=b) for s, b in zip(sources, into)]
    return sqrt(copy_into(into, sources), inplace=True)


SMALL_TENSOR = 1 << 12
"""Elements below which a CPU tensor's own kernel call costs more than its work: lists of such
tensors (on average) take one foreach kernel where a per-tensor ``out=`` call would save a pass."""


def _mostly_small(tensors: Sequence[Tensor]) -> bool:
    return sum(map(Tensor.numel, tensors)) < SMALL_TENSOR * len(tensors)


def div_into(numerators: Sequence[Tensor], denominators: Sequence[Tensor]) -> list[Tensor]:
    """``numerators / denominators`` written over ``denominators`` (our own buffers).

    One ``div`` pass on the CPU; elsewhere ``reciprocal`` then ``mul``, as foreach kernels have no
    reversed division (one rounding more). Either way the pure and the donated paths agree, since
    both call this on buffers they own. Many small tensors on the CPU take one foreach ``div`` (the
    same division) and one foreach copy, where a call per tensor would cost more than the work.
    """
    denominators = list(denominators)
    if _writes_out(denominators, numerators):
        if _mostly_small(denominators) and not torch.compiler.is_compiling():
            return copy_into(denominators, torch_internals.foreach_kernel("div")(list(numerators), denominators))
        if _out_traceable(denominators):
            return [torch.div(n, d, out=d) for n, d in zip(numerators, denominators)]
        return [d.copy_(torch.div(n, d)) for n, d in zip(numerators, denominators)]
    if denominators[0].device.type == "cpu":  # a recorded graph: the same single division
        return [torch.div(n, d) for n, d in zip(numerators, denominators)]
    return mul(reciprocal(denominators, inplace=True), numerators, inplace=True)


def finish(values: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """``values`` cast to the dtype of the updates they replace (a no-op when they match)."""
    return [v if v.dtype == u.dtype else v.to(u.dtype) for v, u in zip(values, like)]
