"""Microbatching (optax.microbatching): run a function over slices of its batch, combine the results.

``microbatch(fun, argnums, microbatch_size, accumulator)`` returns a function that splits its batch
arguments into microbatches, calls ``fun`` on each in turn (a plain Python loop, so only one
microbatch's activations are alive at a time) and combines the outputs: summed, averaged, a
running mean, or concatenated back along axis 0 (:class:`AccumulationType`), or by any
:class:`Accumulator`, chosen per output subtree.

The split is optax's: the batch axis of size ``B = n * m`` is viewed as ``(n, m)`` in column-major
order (:func:`reshape_batch_axis`), so microbatch ``i`` holds rows ``i, i + n, i + 2n, ...`` and a
concatenation puts every row back where it was. :func:`micro_vmap` is ``torch.func.vmap`` run
microbatch by microbatch in the same way, and :func:`micro_grad` per-example gradients on top of it. A module of its own because it wraps functions,
not gradients: it is a tool for computing the gradients a transformation then receives.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import optree
import torch
from torch import Tensor

from gradtx import tree as tree_lib

PyTree = Any
Function = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """How to combine microbatch outputs: ``finalize(update(...update(init(x_0), x_0, 0)..., x_k, k))``.

    Attributes:
      init: ``init(x_0)`` the starting carry, given the first microbatch's output (torch has no
        abstract shape evaluation, so it is handed the value itself; use ``zeros_like`` on it).
      update: ``update(carry, value, index)``, the carry after microbatch ``index``.
      finalize: ``finalize(carry)``, the result.
      aggregate: ``aggregate(values)``, the same reduction over a leading axis of stacked values.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, int], Any]
    finalize: Callable[[Any], Any]
    aggregate: Callable[[Any], Any]


class AccumulationType(enum.Enum):
    """The built-in ways of combining microbatch outputs."""

    MEAN = enum.auto()
    """The sum divided by the number of microbatches (floating point outputs only)."""
    SUM = enum.auto()
    """The sum of the microbatch outputs."""
    RUNNING_MEAN = enum.auto()
    """The mean of the microbatches run (``num_real_microbatches`` of them, when given)."""
    CONCAT = enum.auto()
    """The outputs concatenated along axis 0, rows in the original batch order."""


def _require_floating(kind: str, value: Tensor) -> Tensor:
    if not (value.is_floating_point() or value.is_complex()):
        raise ValueError(f"microbatch: {kind} accumulation requires floating-point outputs, got {value.dtype}")
    return value


def _sum() -> Accumulator:
    return Accumulator(
        init=torch.zeros_like,
        update=lambda carry, value, _: carry + value,
        finalize=lambda carry: carry,
        aggregate=lambda values: values.sum(0),
    )


def _mean(num_microbatches: int) -> Accumulator:
    return Accumulator(
        init=lambda value: torch.zeros_like(_require_floating("MEAN", value)),
        update=lambda carry, value, _: carry + value,
        finalize=lambda carry: carry / num_microbatches,
        aggregate=lambda values: values.mean(0),
    )


def _running_mean() -> Accumulator:
    def update(carry: Tensor, value: Tensor, index: int) -> Tensor:
        kept = index / (index + 1)
        return carry * kept + value * (1 - kept)

    return Accumulator(
        init=lambda value: torch.zeros_like(_require_floating("RUNNING_MEAN", value)),
        update=update,
        finalize=lambda carry: carry,
        aggregate=lambda values: values.mean(0),
    )


def _concat(num_microbatches: int) -> Accumulator:
    def init(value: Tensor) -> Tensor:
        return torch.zeros((num_microbatches, *value.shape), dtype=value.dtype, device=value.device)

    def update(carry: Tensor, value: Tensor, index: int) -> Tensor:
        position = torch.tensor([index], device=carry.device)
        return carry.index_copy(0, position, value.unsqueeze(0).to(carry.dtype))

    def finalize(carry: Tensor) -> Tensor:
        if carry.ndim < 2:
            raise ValueError("microbatch: CONCAT accumulation requires outputs with a leading (batch) axis")
        return carry.transpose(0, 1).reshape(-1, *carry.shape[2:])  # row j*n + i of the batch is (i, j)

    return Accumulator(init, update, finalize, lambda values: values)


def _lift(accumulator: Accumulator) -> Accumulator:
    """An accumulator of tensors applied to every tensor leaf of a subtree."""

    def each(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *trees: tree_lib.tree_map(fn, *trees)

    return Accumulator(
        init=each(lambda v: accumulator.init(torch.as_tensor(v))),
        update=lambda carry, value, index: tree_lib.tree_map(
            lambda c, v: accumulator.update(c, torch.as_tensor(v), index), carry, value
        ),
        finalize=each(accumulator.finalize),
        aggregate=each(accumulator.aggregate),
    )


def _is_accumulator_leaf(node: Any) -> bool:
    return isinstance(node, (Accumulator, AccumulationType))


def _canonicalize(tree: Any, num_microbatches: int) -> Accumulator:
    """One accumulator for the whole output, from a prefix tree of accumulators or types."""

    def one(spec: Any) -> Accumulator:
        if isinstance(spec, Accumulator):
            return spec
        if spec is AccumulationType.MEAN:
            return _lift(_mean(num_microbatches))
        if spec is AccumulationType.SUM:
            return _lift(_sum())
        if spec is AccumulationType.RUNNING_MEAN:
            return _lift(_running_mean())
        if spec is AccumulationType.CONCAT:
            return _lift(_concat(num_microbatches))
        raise ValueError(f"microbatch: unknown accumulator {spec!r}; use an Accumulator or an AccumulationType")

    accumulators = optree.tree_map(one, tree, is_leaf=_is_accumulator_leaf, namespace=tree_lib._NAMESPACE)

    def over(fn: Callable[..., Any]) -> Callable[..., Any]:
        def apply(*trees: Any) -> Any:
            try:
                return optree.tree_map(
                    fn, accumulators, *trees, is_leaf=lambda n: isinstance(n, Accumulator), namespace=tree_lib._NAMESPACE
                )
            except ValueError as error:
                raise ValueError(
                    f"microbatch: the accumulator tree must be a prefix of fun's output structure: {error}"
                ) from None

        return apply

    return Accumulator(
        init=over(lambda acc, value: acc.init(value)),
        update=lambda carry, value, index: over(lambda acc, c, v: acc.update(c, v, index))(carry, value),
        finalize=over(lambda acc, carry: acc.finalize(carry)),
        aggregate=over(lambda acc, values: acc.aggregate(values)),
    )


def reshape_batch_axis(tree: PyTree, microbatch_size: int, axis: int = 0) -> PyTree:
    """Splits axis ``axis`` of every tensor leaf into ``(num_microbatches, microbatch_size)``.

    Column-major, as optax's: element ``i + num_microbatches * j`` goes to ``(i, j)``, so slice
    ``i`` of the new axis is microbatch ``i``.
    """
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, numbers.Integral) or microbatch_size < 1:
        raise ValueError(f"reshape_batch_axis: microbatch_size must be a positive integer, got {microbatch_size!r}")

    def split(x: Tensor) -> Tensor:
        dim = axis if axis >= 0 else axis + x.ndim
        if not 0 <= dim < x.ndim:
            raise ValueError(f"reshape_batch_axis: axis {axis} is out of range for a leaf of shape {tuple(x.shape)}")
        if x.shape[dim] % microbatch_size:
            raise ValueError(
                f"reshape_batch_axis: batch size {x.shape[dim]} (axis {axis}) is not divisible by "
                f"microbatch_size={microbatch_size}"
            )
        return x.unflatten(dim, (microbatch_size, -1)).transpose(dim, dim + 1)

    return tree_lib.tree_map(split, tree)


def _batch_sizes(batch_args: Sequence[tuple[str, Any, int]]) -> list[tuple[str, int]]:
    sizes = []
    for name, value, axis in batch_args:
        leaves = [leaf for leaf in tree_lib.leaves(value) if leaf is not None]
        if not leaves:
            raise ValueError(f"microbatch: batch argument {name} has no tensors")
        for leaf in leaves:
            if not isinstance(leaf, Tensor):
                raise TypeError(f"microbatch: batch argument {name} holds a {type(leaf).__name__}, not a tensor")
            dim = axis if axis >= 0 else axis + leaf.ndim
            if not 0 <= dim < leaf.ndim:
                raise ValueError(f"microbatch: batch argument {name} has a leaf of shape {tuple(leaf.shape)}, no axis {axis}")
            sizes.append((name, leaf.shape[dim]))
    return sizes


def microbatch(
    fun: Function,
    argnums: Union[int, Sequence[int]],
    microbatch_size: Optional[int],
    accumulator: Any = AccumulationType.SUM,
    *,
    argnames: Union[str, Sequence[str]] = (),
    in_axes: Union[int, Sequence[int]] = 0,
    num_real_microbatches: Optional[int] = None,
) -> Function:
    """``fun`` evaluated microbatch by microbatch, its outputs combined (as ``optax.microbatch``).

    Args:
      fun: any function of tensors (pytrees of them).
      argnums: the positional arguments that have a batch axis.
      microbatch_size: rows per microbatch; must divide the batch size. ``None`` returns ``fun``.
      accumulator: an :class:`AccumulationType` or :class:`Accumulator`, or a pytree of them that
        is a prefix of ``fun``'s output (a different combination for each part).
      argnames: the keyword arguments that have a batch axis.
      in_axes: the batch axis of each of ``argnums + argnames`` (one int: all of them).
      num_real_microbatches: run only the first this many microbatches (the rest count as zero
        outputs for ``SUM``/``MEAN``/``CONCAT``; ``RUNNING_MEAN`` averages the ones run).

    Returns:
      a function with ``fun``'s signature.

    ```python
    def loss_and_preds(w, x):
        preds = x @ w
        return preds, preds.square().sum()

    f = gradtx.microbatch(loss_and_preds, argnums=1, microbatch_size=2,
                          accumulator=(gradtx.microbatching.AccumulationType.CONCAT,
                                       gradtx.microbatching.AccumulationType.SUM))
    preds, total = f(torch.ones(3), torch.randn(8, 3))   # as loss_and_preds on the whole batch
    ```
    """
    if microbatch_size is None:
        return fun
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, numbers.Integral) or microbatch_size < 1:
        raise ValueError(f"microbatch: microbatch_size must be a positive integer or None, got {microbatch_size!r}")
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    count = len(argnums) + len(argnames)
    if count == 0:
        raise ValueError("microbatch: give at least one batch argument (argnums or argnames)")
    in_axes = (in_axes,) * count if isinstance(in_axes, int) else tuple(in_axes)
    if len(in_axes) != count:
        raise ValueError(f"microbatch: in_axes has {len(in_axes)} entries for {count} batch arguments (argnums + argnames)")

    def microbatched(*args: Any, **kwargs: Any) -> Any:
        for i in argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(f"microbatch: argnums names argument {i}, but {len(args)} positional arguments were given")
        for name in argnames:
            if name not in kwargs:
                raise ValueError(f"microbatch: argnames names keyword argument {name!r}, which was not given")
        described = [(f"argument {i}", args[i], ax) for i, ax in zip(argnums, in_axes)]
        described += [(f"keyword argument {n!r}", kwargs[n], ax) for n, ax in zip(argnames, in_axes[len(argnums) :])]
        sizes = _batch_sizes(described)
        if len({size for _, size in sizes}) > 1:
            found = ", ".join(f"{name}: {size}" for name, size in sizes)
            raise ValueError(f"microbatch: the batch arguments must have equal batch sizes, found {found}")
        batch_size = sizes[0][1]
        if batch_size % microbatch_size:
            raise ValueError(f"microbatch: batch size {batch_size} is not divisible by microbatch_size={microbatch_size}")
        num_microbatches = batch_size // microbatch_size
        steps = num_microbatches if num_real_microbatches is None else int(num_real_microbatches)
        if not 0 <= steps <= num_microbatches:
            raise ValueError(
                f"microbatch: num_real_microbatches={num_real_microbatches} is outside [0, {num_microbatches}]"
            )
        combine = _canonicalize(accumulator, num_microbatches)

        def call(index: int) -> Any:
            call_args, call_kwargs = list(args), dict(kwargs)

            def take(axis: int) -> Callable[[Tensor], Tensor]:  # rows index, index + n, index + 2n, ...
                return lambda x: x[(slice(None),) * (axis % x.ndim) + (slice(index, None, num_microbatches),)]

            for i, ax in zip(argnums, in_axes):
                call_args[i] = tree_lib.tree_map(take(ax), args[i])
            for name, ax in zip(argnames, in_axes[len(argnums) :]):
                call_kwargs[name] = tree_lib.tree_map(take(ax), kwargs[name])
            return fun(*call_args, **call_kwargs)

        first = call(0)
        carry = combine.init(first)
        for index in range(steps):
            carry = combine.update(carry, first if index == 0 else call(index), index)
        return combine.finalize(carry)

    return microbatched


def micro_vmap(
    fun: Function,
    in_axes: Union[int, None, Sequence[Optional[int]]] = 0,
    out_axes: int = 0,
    *,
    microbatch_size: Optional[int] = None,
    vmap_fn: Callable[..., Function] = torch.func.vmap,
    accumulator: Any = AccumulationType.CONCAT,
    num_real_microbatches: Optional[int] = None,
) -> Function:
    """``torch.func.vmap(fun)`` over the batch, a microbatch at a time (as ``optax.microbatching.micro_vmap``).

    Each microbatch is vmapped and reduced over its examples with the accumulator's ``aggregate``;
    the microbatches are then combined as in :func:`microbatch`. The default ``CONCAT`` gives
    ``vmap``'s result (one row per example, in order); ``SUM``/``MEAN`` reduce over the batch
    without materialising every row. ``in_axes`` gives each positional argument's batch axis
    (``None``: not batched; one int: every positional argument); keyword arguments are batched
    along axis 0, as optax's are. ``out_axes`` must be 0.
    """
    if out_axes != 0:
        raise NotImplementedError("micro_vmap: out_axes other than 0 is not supported (as in optax)")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        axes = (in_axes,) * len(args) if in_axes is None or isinstance(in_axes, int) else tuple(in_axes)
        if len(axes) != len(args):
            raise ValueError(f"micro_vmap: in_axes has {len(axes)} entries for {len(args)} positional arguments")
        batched = tuple(i for i, ax in enumerate(axes) if ax is not None)
        if not batched and not kwargs:
            raise ValueError("micro_vmap: no argument is batched (every in_axes entry is None and no keyword arguments)")

        def call(*values: Any) -> Any:
            return fun(*values[:-1], **values[-1])

        def vmap_reduce(*values: Any, kwargs: dict) -> Any:
            output = vmap_fn(call, in_dims=tuple(axes) + (0 if kwargs else None,), out_dims=0)(*values, kwargs)
            examples = next(leaf for leaf in tree_lib.leaves(output) if isinstance(leaf, Tensor)).shape[0]
            return _canonicalize(accumulator, examples).aggregate(output)

        run = microbatch(
            vmap_reduce,
            argnums=batched,
            microbatch_size=microbatch_size,
            accumulator=accumulator,
            argnames=("kwargs",) if kwargs else (),
            in_axes=tuple(axes[i] for i in batched) + ((0,) if kwargs else ()),
            num_real_microbatches=num_real_microbatches,
        )
        return run(*args, kwargs=kwargs)

    return wrapped


class IndividualOutputs(NamedTuple):
    """The per-example outputs of :func:`micro_grad`: ``fun``'s values, the metrics and ``fun``'s aux."""

    values: Any
    metrics: Any
    aux: Any


def micro_grad(
    fun: Function,
    has_aux: bool = False,
    argnums: Union[int, Sequence[int]] = 0,
    *,
    batch_argnums: Union[int, Sequence[int]] = 1,
    keep_batch_dim: bool = True,
    microbatch_size: Optional[int] = None,
    accumulator: Any = AccumulationType.SUM,
    transform_fn: Callable[[Any], Any] = lambda grads: grads,
    metrics_fn: Callable[[Any], Any] = lambda grads: None,
    num_real_microbatches: Optional[int] = None,
) -> Function:
    """Per-example gradients, transformed and combined over the batch (as ``optax.microbatching.micro_grad``).

    The returned function takes ``fun``'s arguments and returns ``(result, IndividualOutputs)``:
    ``result`` is ``transform_fn`` of each example's gradient (with respect to ``argnums``),
    combined by ``accumulator`` (summed by default); the :class:`IndividualOutputs` hold, per
    example, ``fun``'s value, ``metrics_fn`` of its gradient and ``fun``'s aux (``has_aux``).
    ``batch_argnums`` are the arguments with a batch axis 0; with ``keep_batch_dim`` each example
    reaches ``fun`` as a batch of one. Gradients come from ``torch.func.grad_and_value`` under
    :func:`micro_vmap`, a microbatch at a time. Clipping per-example gradients is
    ``transform_fn``'s job (e.g. scale each to at most a norm).
    """
    batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if not batch_argnums:
        raise ValueError("micro_grad: batch_argnums must name at least one argument")

    empty = ()  # torch.func returns tensors only: None travels as an empty node and comes back as None

    def with_aux(*args: Any, **kwargs: Any) -> Any:
        value, aux = fun(*args, **kwargs) if has_aux else (fun(*args, **kwargs), None)
        return value, (value, empty if aux is None else aux)

    grad_and_value = torch.func.grad_and_value(with_aux, argnums, has_aux=True)

    def per_example(*args: Any, **kwargs: Any) -> Any:
        grads, (_, (value, aux)) = grad_and_value(*args, **kwargs)
        metrics = metrics_fn(grads)
        return transform_fn(grads), (value, empty if metrics is None else metrics, aux)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for i in batch_argnums:
            if not 0 <= i < len(args):
                raise ValueError(f"micro_grad: batch_argnums names argument {i}, but {len(args)} positional arguments were given")
        if keep_batch_dim:
            args = tuple(
                tree_lib.tree_map(lambda x: x.unsqueeze(1), a) if i in batch_argnums else a for i, a in enumerate(args)
            )
        in_axes = [0 if i in batch_argnums else None for i in range(len(args))]
        run = micro_vmap(
            per_example,
            in_axes=in_axes,
            microbatch_size=microbatch_size,
            accumulator=(accumulator, AccumulationType.CONCAT),
            num_real_microbatches=num_real_microbatches,
        )
        result, (values, metrics, aux) = run(*args, **kwargs)
        return result, IndividualOutputs(
            values=values, metrics=None if metrics == empty else metrics, aux=None if aux == empty else aux
        )

    return wrapped


__all__ = ["AccumulationType", "Accumulator", "IndividualOutputs", "micro_grad", "micro_vmap", "microbatch", "reshape_batch_axis"]
