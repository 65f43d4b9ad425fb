"""``from_torch``: any ``torch.optim.Optimizer`` subclass as a pure gradient transformation.

``from_torch(torch.optim.RMSprop, lr=1e-3)`` is a transformation whose update is the step that
optimizer would take, ``new_param - param``, and whose state is the optimizer's per-parameter
state as a pytree: for each parameter leaf a dict of tensors keyed as in ``optimizer.state[p]``
(python numbers some optimizers keep there become 0-d tensors), plus a 0-d bool per leaf saying
whether that state has been created yet (torch optimizers create it on a parameter's first step,
and some treat that step specially).

Two engines compute the step, both with the optimizer's own numbers:

- torch's built-in optimizers (Adam, AdamW, SGD, RMSprop, Adagrad) call their functional kernels
  (single-tensor, foreach or fused, as the hyperparameters say) on lists, with no optimizer object
  in the loop (:mod:`gradtx.interop.torch_kernels`);
- any other class, third-party ones included, runs its own ``step`` on one optimizer object built
  when ``from_torch`` is called (which is also when rejected hyperparameters raise): before each
  step the parameters, gradients and state are loaded into it, afterwards the state is read back.
  ``init`` runs one trial step on copies of the parameters to learn the state's layout.

``params`` are never modified: the step runs on copies. Without ``inplace`` nothing passed in is
modified; with ``inplace=True`` the gradients and state are donated and the optimizer updates
the state tensors in place.

``apply_updates(params, updates)`` then reproduces the optimizer's parameters exactly whenever the
step is small next to the parameter (then ``new - old`` is exact); where a step changes a value by
more than a factor of two the sum may differ from the optimizer's result in the last bit.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from gradtx import torch_internals
from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
from gradtx.interop.torch_kernels import KernelSpec, kernel_for
from gradtx.state_check import named

PyTree = Any
Slots = dict[str, Any]

_PYTHON_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


class FromTorchState(NamedTuple):
    """``slots``: per parameter leaf, the optimizer's state for it (dict of tensors).
    ``initialized``: per parameter leaf, a 0-d bool: whether a step has created that state yet."""

    slots: PyTree
    initialized: PyTree


def _check_class(optimizer_cls: Any) -> None:
    if isinstance(optimizer_cls, torch.optim.Optimizer):
        raise TypeError(
            f"from_torch: expected an optimizer class, got an instance of {type(optimizer_cls).__name__} "
            "(pass the class and its hyperparameters, or use gradtx.wrap for an existing optimizer)"
        )
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"from_torch: expected a torch.optim.Optimizer subclass, got {optimizer_cls!r}")


def _construct(optimizer_cls: type, hyperparams: dict[str, Any]) -> torch.optim.Optimizer:
    """Builds the optimizer on a placeholder parameter, so rejected hyperparameters raise now.

    A vector placeholder first; a matrix one if that is refused (optimizers such as Muon accept
    only 2-D parameters). The first refusal is reported if both are.
    """
    name = optimizer_cls.__name__
    first_error: Optional[Exception] = None
    for shape in ((1,), (2, 2)):
        try:
            return optimizer_cls([torch.zeros(shape, requires_grad=True)], **hyperparams)
        except (TypeError, ValueError, RuntimeError) as error:
            first_error = first_error or error
    kind = TypeError if isinstance(first_error, TypeError) else ValueError
    raise kind(f"from_torch({name}): hyperparameters {hyperparams!r} were rejected: {first_error}") from first_error


def _raw_step(optimizer: torch.optim.Optimizer):
    """The optimizer's ``step`` without the global step hooks torch adds around it."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step.__get__(optimizer, type(optimizer))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b or (isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are treated as changed
        return a is b


# --------------------------------------------------------------------------- engines


class _KernelEngine:
    """Runs a torch optimizer's functional kernel on lists (see :mod:`gradtx.interop.torch_kernels`)."""

    def __init__(self, spec: KernelSpec, group: dict[str, Any]):
        self.spec, self.group = spec, group

    def init_slots(self, params: Sequence[Tensor]) -> list[Slots]:
        return [self.spec.init(p, self.group) for p in params]

    def step(self, work: list[Tensor], grads: list[Tensor], slots: list[Slots], *, inplace: bool) -> list[Slots]:
        """Steps ``work`` (copies of the parameters) in place; returns the new slots."""
        if not inplace:
            slots = [{k: v.clone() for k, v in s.items()} for s in slots]
        with torch.no_grad():
            self.spec.run(work, list(grads), slots, self.group)
        return slots


class _OptimizerEngine:
    """Runs ``optimizer.step`` on one reused optimizer object, loading and reading back the state."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.name = type(optimizer).__name__
        self.group = optimizer.param_groups[0]
        self.placeholder = self.group["params"]
        self.raw_step = _raw_step(optimizer)
        # Per tree structure: for each leaf, the python type of every slot kept as a number
        # (int/float/bool) so it goes back into the optimizer as the type it wrote.
        self.kinds: dict[Any, list[Optional[dict[str, type]]]] = {}

    def _run(
        self, work: list[Tensor], grads: Sequence[Tensor], states: Sequence[Optional[Slots]], *, what: str = "step"
    ) -> list[Slots]:
        optimizer, group = self.optimizer, self.group
        snapshot = {k: v for k, v in group.items() if k != "params"}
        group["params"] = work
        optimizer.state = defaultdict(dict)
        try:
            for w, g, state in zip(work, grads, states):
                w.grad = g
                if state is not None:
                    optimizer.state[w] = state
            try:
                with torch.no_grad():
                    self.raw_step()
            except Exception as error:
                raise RuntimeError(f"from_torch({self.name}): {what} failed: {error}") from error
            by_id = {id(w): w for w in work}
            stray = [k for k in optimizer.state if not (isinstance(k, Tensor) and id(k) in by_id)]
            if stray:
                raise TypeError(
                    f"from_torch({self.name}): the optimizer keeps state under {stray[0]!r}, not under a "
                    "parameter, which from_torch cannot carry; use gradtx.wrap on the optimizer instead"
                )
            changed = [k for k, v in snapshot.items() if not _same(v, group.get(k))]
            if changed:
                raise TypeError(
                    f"from_torch({self.name}): step changes param_groups[{changed[0]!r}], state that "
                    "from_torch cannot carry; use gradtx.wrap on the optimizer instead"
                )
            return [dict(optimizer.state.get(w, {})) for w in work]
        finally:
            for w in work:
                w.grad = None
            group.clear()
            group.update(snapshot)
            group["params"] = self.placeholder
            optimizer.state = defaultdict(dict)

    def _probe(self, params: Sequence[Optional[Tensor]], treedef, paths: Sequence[str]) -> list[Optional[Slots]]:
        """One throwaway step on copies with zero gradients, to learn each leaf's state layout."""
        present = [i for i, p in enumerate(params) if p is not None]
        work = [params[i].detach().clone() for i in present]
        grads = [torch.zeros_like(w) for w in work]
        produced = self._run(work, grads, [None] * len(work), what="a trial step (to learn its state layout)")
        kinds: list[Optional[dict[str, type]]] = [None] * len(params)
        templates: list[Optional[Slots]] = [None] * len(params)
        for i, state in zip(present, produced):
            kinds[i], templates[i] = {}, {}
            for key, value in state.items():
                if isinstance(value, Tensor):
                    templates[i][key] = torch.zeros_like(value)
                elif type(value) in _PYTHON_DTYPES:
                    kinds[i][key] = type(value)
                    templates[i][key] = torch.zeros((), dtype=_PYTHON_DTYPES[type(value)])
                elif value is None:
                    templates[i][key] = None
                else:
                    raise TypeError(
                        f"from_torch({self.name}): leaf {paths[i]!r} has state {key!r} of type "
                        f"{type(value).__name__}, which is not a tensor or a number"
                    )
        self.kinds[treedef] = kinds
        return templates

    def init_slots(self, params: Sequence[Optional[Tensor]], treedef, paths) -> list[Optional[Slots]]:
        return self._probe(params, treedef, paths)

    def kinds_for(self, params, treedef, paths) -> list[Optional[dict[str, type]]]:
        if treedef not in self.kinds:
            self._probe(params, treedef, paths)
        return self.kinds[treedef]

    def step(self, work, grads, slots, initialized, kinds, paths, *, inplace: bool) -> list[Slots]:
        """Steps ``work`` in place through ``optimizer.step``; returns the new slots."""
        grads = list(grads) if inplace else [g.clone() for g in grads]
        flags = torch.stack([f.to("cpu", torch.bool) for f in initialized]).tolist() if initialized else []
        states: list[Optional[Slots]] = []
        for s, ready, leaf_kinds in zip(slots, flags, kinds):
            if not ready:
                states.append(None)
                continue
            state = {}
            for key, value in s.items():
                kind = (leaf_kinds or {}).get(key)
                if kind is not None:
                    state[key] = kind(value.item())
                elif isinstance(value, Tensor) and not inplace:
                    state[key] = value.clone()
                else:
                    state[key] = value
            states.append(state)
        produced = self._run(work, grads, states)
        out = []
        for state, path in zip(produced, paths):
            new = {}
            for key, value in state.items():
                if isinstance(value, Tensor) or value is None:
                    new[key] = value
                elif type(value) in _PYTHON_DTYPES:
                    new[key] = torch.tensor(value, dtype=_PYTHON_DTYPES[type(value)])
                else:
                    raise TypeError(
                        f"from_torch({self.name}): leaf {path!r} has state {key!r} of type "
                        f"{type(value).__name__}, which is not a tensor or a number"
                    )
            out.append(new)
        return out


# --------------------------------------------------------------------------- the transformation


def _check_leaf(owner: str, path: Callable[[], str], grad: Tensor, param: Any) -> None:
    """Raises naming the leaf (its path is computed only then) when ``grad`` cannot step ``param``."""
    if not isinstance(param, Tensor):
        raise ValueError(f"{owner}: leaf {path()!r} has a gradient but no parameter tensor (got {type(param).__name__})")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise ValueError(
            f"{owner}: leaf {path()!r} has gradient {tuple(grad.shape)} {grad.dtype} on {grad.device} but parameter "
            f"{tuple(param.shape)} {param.dtype} on {param.device}; a torch optimizer needs them to match"
        )


def _per_leaf(treedef, tree: PyTree, owner: str, what: str, reference: PyTree) -> list[Any]:
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        raise tree_lib.mismatch_error(tree, reference, what=f"{owner}: state.{what}", like="gradients") from None


def from_torch(optimizer_cls: type, **hyperparams: Any) -> GradientTransformation:
    """Any ``torch.optim.Optimizer`` subclass as a transformation: the update is its step.

    ``from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` gives updates equal to
    ``new_param - param`` after ``AdamW.step`` on the same gradients, with the optimizer's state
    carried in a :class:`FromTorchState`. ``update`` needs ``params``. Hyperparameters the
    optimizer rejects raise here, when the transformation is built. Gradients must match their
    parameters in shape, dtype and device, as torch's optimizers require.
    """
    _check_class(optimizer_cls)
    optimizer = _construct(optimizer_cls, hyperparams)
    owner = f"from_torch({optimizer_cls.__name__})"
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    spec = kernel_for(optimizer_cls, group)
    kernel_engine = _KernelEngine(spec, group) if spec is not None else None
    optimizer_engine = _OptimizerEngine(optimizer) if spec is None else None

    def init_fn(params: PyTree) -> FromTorchState:
        param_leaves, treedef = tree_lib.flatten(params)
        tree_lib.check_tensors(params, param_leaves, what=f"{owner} params")
        if kernel_engine is not None:
            present = [p for p in param_leaves if p is not None]
            made = iter(kernel_engine.init_slots(present))
            slots = [None if p is None else next(made) for p in param_leaves]
        else:
            slots = optimizer_engine.init_slots(param_leaves, treedef, tree_lib.paths(params))
        flags = [None if p is None else torch.zeros((), dtype=torch.bool) for p in param_leaves]
        return FromTorchState(tree_lib.unflatten(treedef, slots), tree_lib.unflatten(treedef, flags))

    def update_fn(updates, state, params=None, *, inplace=False):
        if params is None:
            raise ValueError(f"{owner}: params are required (pass them to update)")
        param_leaves, treedef = tree_lib.flatten(params)
        grad_leaves = tree_lib.flatten_like(updates, treedef, params, what=f"{owner}: gradients", like="params")
        tree_lib.check_tensors(updates, grad_leaves, what=owner)
        present = [i for i, g in enumerate(grad_leaves) if g is not None]
        slot_leaves = _per_leaf(treedef, state.slots, owner, "slots", updates)
        flag_leaves = _per_leaf(treedef, state.initialized, owner, "initialized", updates)
        for i in present:
            _check_leaf(owner, lambda i=i: tree_lib.path_at(updates, i), grad_leaves[i], param_leaves[i])
        params_now = [param_leaves[i].detach() for i in present]
        work = [p.clone() for p in params_now]
        grads = [grad_leaves[i] for i in present]
        slots = [slot_leaves[i] for i in present]
        if kernel_engine is not None:
            new_slots = kernel_engine.step(work, grads, slots, inplace=inplace)
        else:
            all_paths = tree_lib.paths(updates)
            kinds = optimizer_engine.kinds_for(param_leaves, treedef, all_paths)
            new_slots = optimizer_engine.step(
                work,
                grads,
                slots,
                [flag_leaves[i] for i in present],
                [kinds[i] for i in present],
                [all_paths[i] for i in present],
                inplace=inplace,
            )
        if work:
            torch_internals.foreach_kernel("sub_")(work, params_now)  # work now holds new_param - param
        out_updates: list[Any] = [None] * len(grad_leaves)
        out_slots, out_flags = list(slot_leaves), list(flag_leaves)
        for j, i in enumerate(present):
            out_updates[i] = work[j]
            out_slots[i] = new_slots[j]
            out_flags[i] = torch.ones((), dtype=torch.bool)
        new_state = FromTorchState(tree_lib.unflatten(treedef, out_slots), tree_lib.unflatten(treedef, out_flags))
        return tree_lib.unflatten(treedef, out_updates), new_state

    return GradientTransformation(init_fn, named(update_fn, owner))
