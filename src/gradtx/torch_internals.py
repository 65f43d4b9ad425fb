"""The private torch APIs gradtx uses, each behind an accessor that falls back where torch lacks it.

Torch's public API has no equivalent for a few things gradtx needs: foreach kernels (one call per
(device, dtype) group instead of one per tensor), torch's C++ grouping of tensors by device and
dtype, whether a tensor is wrapped by a ``torch.func`` transform, and the dtype ``torch.optim``
keeps its step counts in. Each use goes through a function here, which takes a public, slower path
(or, where nothing public can stand in, raises an error naming the API) on a torch release that
lacks the private one.

The private APIs used elsewhere are guarded where they are used: DTensor and DeviceMesh internals
in ``gradtx.sharding.dtensor`` and ``gradtx.sharding.plan`` (only ``sharding/`` touches
``torch.distributed``), ``torch.optim``'s hook machinery in ``gradtx.interop.wrap``, Dynamo's
config and errors in ``gradtx.compiled_step``, storage reference counts in ``gradtx.buffer_pool``.
:data:`PRIVATE_APIS` names every one of them: the tests check that the running torch has each (so a
torch release that drops one fails with its name) and that each fallback works without it.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

# Foreach kernels gradtx calls, by the name after ``torch._foreach_``: those reached through
# ``tree.foreach`` in both forms (in place, ``name_``, and out of place), and those called directly.
FOREACH_OPS = (
    "abs", "add", "addcmul", "clamp_max", "clamp_min", "div", "lerp", "maximum", "mul", "pow",
    "reciprocal", "sign", "sqrt", "sub", "tanh",
)  # fmt: skip
FOREACH_KERNELS = tuple(sorted({*FOREACH_OPS, *(f"{name}_" for name in FOREACH_OPS), "copy_", "norm", "zero_"}))

# Every private torch API gradtx relies on, as ``module.attribute`` paths. ``A | B`` accepts either
# (torch renamed A to B, or B to A); ``Class().attribute`` is an attribute of instances only.
PRIVATE_APIS = (
    *(f"torch._foreach_{name}" for name in FOREACH_KERNELS),
    "torch._C._group_tensors_by_device_and_dtype",
    "torch.utils._foreach_utils._group_tensors_by_device_and_dtype",
    "torch._C._functorch.maybe_current_level",
    "torch._C._functorch.is_functorch_wrapped_tensor",
    "torch._C._functorch.get_unwrapped",
    "torch.optim.optimizer._get_scalar_dtype",
    # gradtx.buffer_pool: a storage's reference counts
    "torch._C._storage_Use_Count",
    "torch.UntypedStorage._cdata",
    "torch.UntypedStorage._weak_ref",
    "torch.UntypedStorage._free_weak_ref",
    # gradtx.interop.wrap: torch.optim's step hooks, run by the wrapper itself
    "torch.optim.optimizer._global_optimizer_pre_hooks",
    "torch.optim.optimizer._global_optimizer_post_hooks",
    "torch.optim.Optimizer._optimizer_step_code",
    "torch.optim.Optimizer()._optimizer_step_pre_hooks",
    "torch.optim.Optimizer()._optimizer_step_post_hooks",
    "torch.optim.Optimizer().step.__wrapped__",
    # gradtx.compiled_step: Dynamo's recompile limits and the error it raises at one
    "torch._dynamo.config.recompile_limit | torch._dynamo.config.cache_size_limit",
    "torch._dynamo.config.accumulated_recompile_limit | torch._dynamo.config.accumulated_cache_size_limit",
    "torch._dynamo.exc.FailOnRecompileLimitHit | torch._dynamo.exc.FailOnCacheLimitHit",
    "torch._dynamo.exc.TorchDynamoException",
    "torch._dynamo.eval_frame._debug_get_cache_entry_list",
    # gradtx.sharding: DTensor and DeviceMesh internals
    "torch.distributed.tensor.DTensor._local_tensor",
    "torch.distributed.tensor.DTensor._spec",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.device_mesh.DeviceMesh._get_root_mesh",
    "torch.distributed.distributed_c10d._world.group_count",
    # gradtx.sharding.checkpointing: Pieces, a wrapper tensor implementing DCP's chunk protocol
    "torch.Tensor._make_wrapper_subclass",
    "torch._C._disabled_torch_function_impl",
    # gradtx.quantization.kernels: a table lookup Inductor compiles without index checks
    "torch.ops.aten._unsafe_index",
    # gradtx.compiled_fusion: Inductor's fusion heuristics, overridden for compile_step's graphs
    "torch._inductor.choices.InductorChoices",
    "torch._inductor.choices.InductorChoices.can_fuse_horizontal",
    "torch._inductor.virtualized.V.set_choices_handler",
    "torch._inductor.config.inductor_choices_class",
    "torch._inductor.config.score_fusion_memory_threshold",
    # gradtx.packing: many small tensors copied into one and viewed back, in C++
    "torch._C._nn.flatten_dense_tensors",
    "torch._C._nn.unflatten_dense_tensors",
)


# --------------------------------------------------------------------------- foreach kernels


def foreach_kernel(name: str) -> Callable[..., Any]:
    """``torch._foreach_<name>`` (``name`` ending in ``_`` for the in-place kernel), or where this
    torch lacks it the same op applied tensor by tensor, with the same arguments and results."""
    kernel = getattr(torch, f"_foreach_{name}", None)
    return kernel if kernel is not None else functools.partial(_one_by_one, name)


def _one_by_one(name: str, selves: Sequence[Tensor], *args: Any, **kwargs: Any) -> Optional[list[Tensor]]:
    """A foreach kernel's work as one op per tensor: a list argument gives each tensor its entry,
    anything else is passed to every one. In place (``name_``) returns ``None``, as the kernels do."""
    columns = [a if isinstance(a, (list, tuple)) else itertools.repeat(a) for a in args]
    if name == "norm":
        return [torch.linalg.vector_norm(s, *xs, **kwargs) for s, *xs in zip(selves, *columns)]
    if not name.endswith("_"):
        op = getattr(torch, name)
        return [op(s, *xs, **kwargs) for s, *xs in zip(selves, *columns)]
    for s, *xs in zip(selves, *columns):
        method = getattr(s, name, None)
        if method is not None:
            method(*xs, **kwargs)
        else:  # no Tensor method (``maximum_``): the op written into the tensor itself
            getattr(torch, name[:-1])(s, *xs, out=s, **kwargs)
    return None


# --------------------------------------------------------------------------- packing


def flatten_dense_tensors(tensors: Sequence[Tensor]) -> Tensor:
    """Contiguous ``tensors`` copied end to end into one 1-d tensor: one native call, where this
    torch has it, else one ``cat`` of their flat views."""
    native = getattr(torch._C._nn, "flatten_dense_tensors", None)
    if native is not None:
        return native(list(tensors))
    return torch.cat([t.view(-1) for t in tensors])


def unflatten_dense_tensors(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of the 1-d ``flat`` shaped as ``like``, end to end (what :func:`flatten_dense_tensors` packed)."""
    native = getattr(torch._C._nn, "unflatten_dense_tensors", None)
    if native is not None:
        return list(native(flat, list(like)))
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


# --------------------------------------------------------------------------- grouping


def device_dtype_groups(tensors: Sequence[Tensor], *, native: bool = True) -> list[list[int]]:
    """The indices of ``tensors`` by (device, dtype), groups in the order of their first tensor.

    ``native``: found by torch's C++ grouping (a Python loop costs more than a foreach kernel on
    thousands of small tensors), where this torch has it; it cannot run under ``torch.compile``
    or on ``torch.func``-wrapped tensors, where the caller passes ``native=False``.
    """
    group = getattr(torch._C, "_group_tensors_by_device_and_dtype", None) if native else None
    if group is None:
        if one_device_and_dtype(tensors):  # (no per-tensor step for Dynamo to trace)
            return [list(range(len(tensors)))] if tensors else []
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_key.setdefault((tensor.device, tensor.dtype), []).append(index)
        return list(by_key.values())
    groups = group([list(tensors)], True)
    return sorted((list(indices) for _, indices in groups.values()), key=lambda indices: indices[0])


def devices_of(tensors: Sequence[Tensor], *, native: bool = True) -> set[torch.device]:
    """The devices ``tensors`` sit on, found as :func:`device_dtype_groups` finds its groups."""
    group = getattr(torch._C, "_group_tensors_by_device_and_dtype", None) if native else None
    if group is None:
        return {tensor.device for tensor in tensors}
    return {device for device, _ in group([list(tensors)], False)}


def one_device_and_dtype(tensors: Sequence[Tensor]) -> bool:
    """Whether all ``tensors`` (at least one) share one device and one dtype, found in native maps
    and a list comparison: no per-tensor Python step, eagerly or for Dynamo to trace."""
    n = len(tensors)
    devices = list(map(getattr, tensors, ["device"] * n))
    dtypes = list(map(getattr, tensors, ["dtype"] * n))
    return n > 0 and devices == [devices[0]] * n and dtypes == [dtypes[0]] * n


def clip_grad_norm_groups(tensors: Sequence[Tensor]) -> list[list[int]]:
    """The indices of each (device, dtype) group of ``tensors``, groups in the order
    ``torch.nn.utils.clip_grad_norm_`` visits them (that of the grouping it calls, a hash map in
    C++), or in order of first appearance where this torch lacks that grouping."""
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    except ImportError:
        return device_dtype_groups(tensors)
    groups = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
    return [list(indices) for _, indices in groups.values()]


# --------------------------------------------------------------------------- torch.func


def _functorch(name: str) -> Optional[Callable[..., Any]]:
    return getattr(getattr(torch._C, "_functorch", None), name, None)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform is running (only then can tensors be functorch-wrapped).

    ``True`` where this torch cannot tell: the differentiable, one-op-per-tensor paths are then
    taken, which are right whether or not a transform runs."""
    level = _functorch("maybe_current_level")
    return level is None or level() is not None


def _always(tensor: Any) -> bool:
    return True


def wrapped_check() -> Callable[[Tensor], bool]:
    """The test for "is this tensor wrapped by a ``torch.func`` transform"; where this torch lacks
    it, one that says every tensor may be (the safe answer: only slower)."""
    check = _functorch("is_functorch_wrapped_tensor")
    return check if check is not None else _always


def functorch_unwrapped(tensor: Tensor, *, owner: str) -> Tensor:
    """``tensor`` with every ``torch.func`` wrapper taken off (for values with no derivative that a
    host-side API must read, such as a generator's state).

    Where this torch cannot unwrap, ``tensor`` itself outside transforms, and a ``RuntimeError``
    naming the missing API inside one."""
    is_wrapped, unwrap = _functorch("is_functorch_wrapped_tensor"), _functorch("get_unwrapped")
    if is_wrapped is None or unwrap is None:
        if functorch_active():
            raise RuntimeError(
                f"{owner}: under a torch.func transform this needs torch._C._functorch.is_functorch_wrapped_tensor "
                f"and get_unwrapped, which torch {torch.__version__} lacks; call it outside torch.func transforms"
            )
        return tensor
    while is_wrapped(tensor):
        tensor = unwrap(tensor)
    return tensor


# --------------------------------------------------------------------------- indexing


# ``table[index]`` with no bounds check (an ATen op of Inductor's own lowerings), or ``None`` where
# this torch lacks it: callers then index as usual, with the same values.
unchecked_index: Optional[Callable[..., Tensor]] = getattr(torch.ops.aten, "_unsafe_index", None)


# --------------------------------------------------------------------------- torch.optim


def optimizer_scalar_dtype(is_fused: Optional[bool] = None) -> torch.dtype:
    """The dtype ``torch.optim``'s optimizers keep a step count in (``_get_scalar_dtype``); where
    this torch lacks it, its rule: float32 for fused kernels, else the default dtype's precision
    (float64 when the default is float64, else float32)."""
    from torch.optim import optimizer

    scalar_dtype = getattr(optimizer, "_get_scalar_dtype", None)
    if scalar_dtype is not None:
        return scalar_dtype(is_fused=is_fused)
    if is_fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
