"""The core abstraction: a gradient transformation is a pair of pure functions.

``init(params) -> state`` builds the state; ``update(updates, state, params=None, *, inplace=False)
-> (updates, state)`` transforms a gradient pytree. ``update`` never mutates what it is given,
unless the caller passes ``inplace=True`` and so donates ``updates`` and ``state`` (never ``params``)
to be overwritten and reused; both paths give identical numbers.

A :class:`GradientTransformationExtraArgs` also takes keyword arguments beyond those (as in optax:
``value=`` the objective at ``params``, ``grad=`` its gradient, ``value_fn=`` the objective as a
function of the params, and anything ``value_fn`` needs). Combinators forward such arguments to
the transformations that take them, and only to those.

A third value, ``inplace="updates"`` (:data:`DONATE_UPDATES`), donates the ``updates`` only: their
buffers may be overwritten, the ``state`` must come back new. :func:`~gradtx.chain` uses it on a pure
step to hand each member the fresh updates the member before it made, so the members after the first
work in those buffers instead of allocating their own. A transformation takes that value only if it
says so (:func:`supports_donated_updates`); the others are called pure.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, NamedTuple, Optional, Protocol, Tuple, Union

import torch

from gradtx import buffer_pool, packing, state_check
from gradtx import torch_internals
from gradtx import tree as tree_lib

PyTree = Any
Params = PyTree
"""The parameters: a pytree of tensors (a dict of them, say); ``None`` leaves have no parameter."""
Updates = PyTree
"""Gradients or updates: a pytree with the structure of the params; a ``None`` leaf means no gradient."""
OptState = PyTree
"""A transformation's state: a pytree of tensors (counters are 0-d tensors), so it saves and moves."""
MaskOrFn = Optional[Union[Any, Callable[[Params], Any]]]
"""A mask argument (``weight_decay_mask``, ``mask``): ``None`` (no mask), a tree of bools with the
structure of the params or a prefix of it, or a callable building one from the params (as optax's)."""


class TransformInitFn(Protocol):
    """``init(params) -> state``: the state a transformation starts from, for these params."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None, *, inplace=False) -> (updates, state)``: one pure step.

    With ``inplace=True`` the caller donates ``updates`` and ``state``, which may be overwritten.
    """

    def __call__(
        self, updates: Updates, state: OptState, params: Optional[Params] = None, *, inplace: bool = False
    ) -> Tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure gradient transformation: ``init(params)`` and ``update(updates, state, params, *, inplace)``."""

    init: TransformInitFn
    update: TransformUpdateFn


class TransformUpdateExtraArgsFn(Protocol):
    """:class:`TransformUpdateFn` that also takes keyword arguments (``value=``, ``grad=``, ...)."""

    def __call__(
        self,
        updates: Updates,
        state: OptState,
        params: Optional[Params] = None,
        *,
        inplace: bool = False,
        **extra_args: Any,
    ) -> Tuple[Updates, OptState]: ...


class GradientTransformationExtraArgs(GradientTransformation):
    """A gradient transformation whose ``update`` also takes keyword arguments (``**extra_args``).

    Still a ``GradientTransformation`` (the same ``(init, update)`` pair, ``isinstance`` holds), so it
    goes wherever one does. Being of this type is how a transformation says it wants extra
    arguments: :func:`~gradtx.chain` and the other combinators pass them on to it, and never to a
    plain ``GradientTransformation``.
    """

    update: TransformUpdateExtraArgsFn  # type: ignore[assignment]


DONATE_UPDATES = "updates"
"""The ``inplace`` value that donates the updates and not the state (see the module docstring)."""


def donation(inplace: Any) -> tuple[bool, bool]:
    """``(updates donated, state donated)`` for an ``update``'s ``inplace`` argument."""
    if isinstance(inplace, str):
        if inplace != DONATE_UPDATES:
            raise ValueError(f"inplace must be a bool or {DONATE_UPDATES!r}, got {inplace!r}")
        return True, False
    return bool(inplace), bool(inplace)


_TAKES_DONATED = "takes_donated_updates"
_RETURNS_NEW = "returns_new_updates"


def supports_donated_updates(update_fn: Callable, *, returns_new_updates: bool = True) -> Callable:
    """Marks ``update_fn`` as one that takes ``inplace="updates"``, and returns it.

    The mark promises: given ``inplace="updates"`` the function may overwrite the updates' buffers but
    leaves its state's alone (the new state is new tensors), and every update it returns is either a
    new tensor or one of the given update buffers. ``returns_new_updates=True`` promises more: called
    pure, every update it returns is a new tensor held by nothing else (not an input, not its state),
    so :func:`~gradtx.chain` may donate it to the next member.
    """
    setattr(update_fn, _TAKES_DONATED, True)
    setattr(update_fn, _RETURNS_NEW, bool(returns_new_updates))
    return update_fn


def takes_donated_updates(tx: GradientTransformation) -> bool:
    """Whether ``tx.update`` takes ``inplace="updates"`` (see :func:`supports_donated_updates`)."""
    return bool(getattr(tx.update, _TAKES_DONATED, False))


def returns_new_updates(tx: GradientTransformation) -> bool:
    """Whether ``tx.update``, called pure, returns updates nothing else holds (see :func:`supports_donated_updates`)."""
    return bool(getattr(tx.update, _RETURNS_NEW, False))


# ``scale(tensors, coefficient, inplace) -> tensors * coefficient`` (in place into ``tensors`` when ``inplace``)
Scaling = Callable[[list[Any], Any, bool], list[Any]]


class LeadingClip(NamedTuple):
    """The ``clip_by_global_norm`` that is the first to see a transformation's updates (the
    transformation itself, or the first member of a chain), as :func:`leading_clip` finds it.

    ``spec`` and ``norm_type``: the clip's; ``norm_of(state)``: the norm it recorded in the
    transformation's state; ``coefficient(state, norm)``: the factor it scales by for that norm;
    ``given(norm, scale=None)``: the transformation's ``update`` (taking ``inplace`` and extra
    arguments as :func:`with_inplace` gives it) with that clip taking ``norm`` as its global norm
    instead of computing it: the same numbers, without the clip's reduction. A caller that has
    reduced the norm already (``gradtx.observe``, in the all-reduce of its statistics) passes it on
    this way. ``scale`` (a :data:`Scaling`), when given, multiplies the gradients by the clip's
    coefficient in place of the clip's own product, and must return the same numbers: ``observe``
    reads its statistics of the gradients in that pass.
    """

    spec: Any
    norm_type: float
    norm_of: Callable[[Any], Any]
    coefficient: Callable[[Any, Any], Any]
    given: Callable[..., Callable]


_LEADING_CLIP = "leading_clip"


_SPEC = "sharding_spec"  # on an update: the ShardingSpec its factory was given (None: none)
_SPEC_OWNER = "_gradtx_spec_owner"  # on an update: the name of the factory that was given the spec
_INNER = "_gradtx_inner"  # on a combinator's update: the transformations it runs
_UNTRACEABLE = "_gradtx_untraceable"  # on an update torch.compile cannot trace: (its owner, why)
_WHOLE = "_gradtx_wraps"  # on an init: the transformation it starts, kept as one (see kept_whole)
_UNSHARDED = "_gradtx_unsharded"  # on an update that reduces over the tree and takes no spec: (its owner, what)


def takes_spec(factory: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """Marks a factory with a ``spec`` argument (a :class:`~gradtx.sharding.ShardingSpec` its
    transformation needs where plain tensors are sharded): its transformations' updates carry the
    spec they were given, by which ``gradtx.wrap(..., spec=)`` finds a member given none (see
    :func:`members_without_spec`), which would compute from this rank's pieces alone."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        tx = factory(*args, **kwargs)
        if torch.compiler.is_compiling():  # built while a step is traced (inject_hyperparams): wrap checked it eagerly
            return tx
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        try:
            setattr(tx.update, _SPEC, bound.arguments.get("spec"))
            setattr(tx.update, _SPEC_OWNER, factory.__name__)
        except AttributeError:  # an update that takes no attributes (a bound method): nothing to mark
            pass
        return tx

    return build


def runs_inner(update_fn: Callable, *inner: GradientTransformation) -> Callable:
    """Records the transformations a combinator's ``update_fn`` runs (``masked``, ``partition``,
    ``MultiSteps``, ...), for :func:`members_without_spec`; returns ``update_fn``."""
    setattr(update_fn, _INNER, tuple(inner))
    return update_fn


def kept_whole(init_fn: Callable, tx: GradientTransformation) -> Callable:
    """Records that ``init_fn`` starts ``tx`` kept as one transformation (an optimizer alias, whose
    state an enclosing chain nests instead of splicing): walks over members still see inside it.
    Returns ``init_fn``."""
    setattr(init_fn, _WHOLE, tx)
    return init_fn


def _members(tx: GradientTransformation) -> list[GradientTransformation]:
    """``tx`` itself, a chain's members and what combinators run, at any depth, each once."""
    from gradtx.chains.chain import _PARTS  # chain's record of its members (it imports this module)

    found: list[GradientTransformation] = []
    seen: set[int] = set()

    def visit(node: GradientTransformation) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        found.append(node)
        for part in getattr(node.init, _PARTS, ()):
            visit(part)
        wrapped = getattr(node.init, _WHOLE, None)  # an alias's chain, kept whole (see kept_whole)
        if wrapped is not None:
            visit(wrapped)
        for inner in getattr(node.update, _INNER, ()):
            visit(inner)

    visit(tx)
    return found


def _name_of(update: Callable) -> str:
    return getattr(update, _SPEC_OWNER, None) or getattr(update, "__qualname__", "a member").split(".<locals>")[0]


def members_without_spec(tx: GradientTransformation) -> list[str]:
    """The names of the transformations in ``tx`` (itself, a chain's members, what combinators run,
    at any depth) that take a ``spec`` and were given none."""
    return list(dict.fromkeys(_name_of(node.update) for node in _members(tx) if getattr(node.update, _SPEC, ...) is None))


def unsharded_only(update_fn: Callable, owner: str, what: str) -> Callable:
    """Marks ``update_fn`` as one that reduces over the whole tree (``what`` it computes) and takes
    no ``spec``: on sharded plain tensors it would work from this rank's pieces alone, so
    ``gradtx.wrap(..., spec=)`` refuses a chain holding it (:func:`members_unsharded_only`).
    Returns ``update_fn``."""
    setattr(update_fn, _UNSHARDED, (owner, what))
    return update_fn


def members_unsharded_only(tx: GradientTransformation) -> list[tuple[str, str]]:
    """``(owner, what)`` of each member of ``tx`` (at any depth, as :func:`members_without_spec`
    walks them) marked by :func:`unsharded_only`."""
    return list(dict.fromkeys(getattr(node.update, _UNSHARDED) for node in _members(tx) if hasattr(node.update, _UNSHARDED)))


def untraceable(update_fn: Callable, owner: str, why: str) -> Callable:
    """Marks ``update_fn`` (of ``owner``) as one ``torch.compile`` cannot trace, and says ``why``:
    :func:`gradtx.compile_step` refuses a step holding it up front, naming it, instead of failing
    inside the tracer. Returns ``update_fn``."""
    setattr(update_fn, _UNTRACEABLE, (owner, why))
    return update_fn


def untraceable_members(tx: GradientTransformation) -> list[tuple[str, str]]:
    """``(name, why)`` of each member of ``tx`` (at any depth) marked :func:`untraceable`."""
    return list(dict.fromkeys(getattr(node.update, _UNTRACEABLE) for node in _members(tx) if hasattr(node.update, _UNTRACEABLE)))


def set_leading_clip(update_fn: Callable, clip: Optional[LeadingClip]) -> Callable:
    """Records ``clip`` on ``update_fn`` (nothing when it is ``None``), and returns ``update_fn``."""
    if clip is not None:
        setattr(update_fn, _LEADING_CLIP, clip)
    return update_fn


def leading_clip(tx: GradientTransformation) -> Optional[LeadingClip]:
    """The global-norm clip that sees ``tx``'s updates first, or ``None`` (see :class:`LeadingClip`)."""
    return getattr(tx.update, _LEADING_CLIP, None)


_SCALED_UPDATE = "scaled_update"


def takes_scaled_gradients(update_fn: Callable, scaled_update: Callable) -> Callable:
    """Records on ``update_fn`` its ``scaled_update``, and returns ``update_fn``.

    ``scaled_update(updates, state, params=None, *, inplace=False, grad_scale, scaling=None)`` must
    return what ``update_fn`` returns for ``updates`` multiplied by the 0-d ``grad_scale`` first
    (by ``scaling``, a :data:`Scaling`, when given, else as ``clip_by_global_norm`` multiplies), the
    same numbers, with ``inplace`` as ``update_fn`` takes it for the unscaled updates (and no extra
    arguments: a chain hands nothing to a member that takes them). A
    :func:`~gradtx.chain` hands a global-norm clip's coefficient to the member after it this way:
    a kernel that reads the gradients anyway takes the product there, and no scaled copy is made.
    """
    setattr(update_fn, _SCALED_UPDATE, scaled_update)
    return update_fn


def scaled_update_of(update_fn: Callable) -> Optional[Callable]:
    """``update_fn``'s ``scaled_update`` (see :func:`takes_scaled_gradients`), or ``None``."""
    return getattr(update_fn, _SCALED_UPDATE, None)


_ELEMENTWISE = "elementwise"


def set_elementwise(update_fn: Callable, elementwise: bool = True) -> Callable:
    """Marks ``update_fn`` as elementwise (when ``elementwise``), and returns it.

    The mark promises: each element of an update, and of every state leaf shaped like the params,
    depends only on the same element of the gradient, of the param and of that state, and on state
    that is not params-shaped (step counts), which comes out the same whichever leaves are given.
    So ``update`` may run on a subset of the leaves (the others ``None``) or on a range of rows of
    a leaf, and gives those elements' numbers: :func:`gradtx.quantize_state` steps a few leaves at
    a time on that promise. Adam, Lion, momentum and plain scalings keep it; a global-norm clip,
    per-leaf norms or a mask computed from the params do not.
    """
    if elementwise:
        setattr(update_fn, _ELEMENTWISE, True)
    return update_fn


def is_elementwise(tx: GradientTransformation) -> bool:
    """Whether ``tx.update`` is marked elementwise (see :func:`set_elementwise`)."""
    return bool(getattr(tx.update, _ELEMENTWISE, False))


class EmptyState(NamedTuple):
    """The state of a stateless transformation: a pytree with no leaves."""


def _checked_transformation(cls: type, init: TransformInitFn, update: TransformUpdateFn) -> Any:
    """Builds a transformation whose ``update`` checks the state it is given against what ``init``
    makes, and names the transformation when it is not (see :mod:`gradtx.state_check`)."""
    state_type = EmptyState if init is init_empty_state else None
    return tuple.__new__(cls, state_check.checked(init, update, state_type=state_type))


GradientTransformation.__new__ = _checked_transformation  # type: ignore[method-assign]


def _accepts_inplace(update_fn: Callable, *, var_keyword: bool = True) -> bool:
    """Whether ``update_fn`` takes ``inplace=`` (by name, or through ``**kwargs`` if ``var_keyword``).

    A Python function (through ``functools.wraps``' ``__wrapped__``, as ``inspect.signature`` goes)
    is read from its code object: Dynamo traces that where it cannot trace ``inspect.signature``,
    and transformations are built while a step is traced (``inject_hyperparams`` builds its inner
    transformation from each step's values)."""
    fn = update_fn
    while isinstance(fn, types.FunctionType) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        named = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        return "inplace" in named or (var_keyword and bool(code.co_flags & inspect.CO_VARKEYWORDS))
    try:
        parameters = inspect.signature(update_fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.name == "inplace" or (var_keyword and p.kind is inspect.Parameter.VAR_KEYWORD) for p in parameters
    )


def takes_extra_args(tx: GradientTransformation) -> bool:
    """Whether combinators forward extra keyword arguments to ``tx`` (it is a ``GradientTransformationExtraArgs``)."""
    return isinstance(tx, GradientTransformationExtraArgs)


def with_inplace(tx: GradientTransformation) -> TransformUpdateFn:
    """``tx.update``, made to accept the ``inplace`` keyword if it does not already.

    Hand-written optax-style update functions ``(updates, state, params=None)`` thus work inside
    combinators; they always take the pure path, which gives the same numbers. Decided once, when
    the combinator is built, so nothing is inspected per step.

    For a :class:`GradientTransformationExtraArgs` the result also takes ``**extra_args`` and passes
    them on; its ``inplace`` is passed only if its ``update`` names it (an optax-style
    ``update(updates, state, params=None, **extra_args)`` does not see it among its extra arguments).
    """
    if takes_extra_args(tx):
        if _accepts_inplace(tx.update, var_keyword=False):
            return tx.update

        def update_extra_args(updates, state, params=None, *, inplace=False, **extra_args):
            del inplace
            return tx.update(updates, state, params, **extra_args)

        return update_extra_args
    if _accepts_inplace(tx.update):
        return tx.update

    def update_fn(updates, state, params=None, *, inplace=False):
        del inplace
        return tx.update(updates, state, params)

    return update_fn


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformationExtraArgs:
    """``tx`` as a :class:`GradientTransformationExtraArgs` that accepts extra arguments and ignores them.

    A transformation that already takes them is returned as it is.
    """
    if takes_extra_args(tx):
        return tx  # type: ignore[return-value]
    update = with_inplace(tx)

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        del extra_args
        return update(updates, state, params, inplace=inplace)

    return GradientTransformationExtraArgs(tx.init, state_check.named(update_fn, state_check.name_of(tx.update)))


def init_empty_state(params: Params) -> EmptyState:
    """The ``init`` of every stateless transformation."""
    del params
    return EmptyState()


def real_empty_state(owner: str, why: str) -> Callable[[Params], EmptyState]:
    """The ``init`` of a stateless transformation that has no complex form: it refuses complex
    params (a ``TypeError`` naming the leaf, saying ``why``) and keeps nothing."""

    def init_fn(params: Params) -> EmptyState:
        tree_lib.refuse_complex(params, owner=owner, why=why)
        return EmptyState()

    return init_fn


def identity() -> GradientTransformation:
    """Leaves updates untouched."""

    def update_fn(updates, state, params=None, *, inplace=False):
        del params, inplace
        return updates, state

    return GradientTransformation(init_empty_state, set_elementwise(supports_donated_updates(update_fn, returns_new_updates=False)))


def stateless(fn: Callable[[Updates, Optional[Params]], Updates]) -> GradientTransformation:
    """Makes a transformation from a pure function ``fn(updates, params) -> updates``."""

    def update_fn(updates, state, params=None, *, inplace=False):
        del inplace
        return fn(updates, params), state

    return GradientTransformation(init_empty_state, update_fn)


def _positional_arity(fn: Callable) -> int:
    """How many positional arguments ``fn`` takes (2 for ``*args``); 1 where it cannot be told."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return 1
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in parameters)


def stateless_with_tree_map(
    fn: Union[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]],
) -> GradientTransformation:
    """Makes a transformation applying ``fn`` to every (non-``None``) leaf.

    ``fn(update, param)`` as in optax, with ``param`` ``None`` when ``update`` is called without
    params; a function of one positional argument is called as ``fn(update)``.
    """
    if _positional_arity(fn) < 2:
        return stateless(lambda updates, params: tree_lib.tree_map(fn, updates))

    def apply(updates, params):
        if params is None:
            return tree_lib.tree_map(lambda u: fn(u, None), updates)
        return tree_lib.tree_map(fn, updates, params, names=("stateless_with_tree_map: updates", "params"))

    return stateless(apply)


def paired_leaves(params: Params, updates: Updates, *, owner: str) -> tuple[list[Any], list[Any], Any, list[int]]:
    """The leaves of ``params`` and of ``updates`` (same structure, tensors or ``None``), their
    structure, and the indices where an update meets its parameter. A mismatch (structure, a leaf
    that is not a tensor, an update for a ``None`` parameter, another shape) is a ``ValueError`` or
    ``TypeError`` naming the leaf's path, raised before any computation."""
    param_leaves, treedef, _ = tree_lib.tensor_leaves(params, what="params")
    update_leaves = tree_lib.flatten_like(updates, treedef, params, what=f"{owner}: updates", like="params")
    tree_lib.check_tensors(updates, update_leaves, what="updates", allow_none=True)
    pairs = []
    for index, (param, update) in enumerate(zip(param_leaves, update_leaves)):
        if update is None:
            continue
        if param is None:
            raise ValueError(f"{owner}: leaf {tree_lib.path_at(params, index)!r} has an update but no parameter (None)")
        if update.shape != param.shape:
            raise ValueError(
                f"{owner}: leaf {tree_lib.path_at(params, index)!r} has update shape {tuple(update.shape)} "
                f"but parameter shape {tuple(param.shape)}"
            )
        pairs.append(index)
    return param_leaves, update_leaves, treedef, pairs


def apply_updates(params: Params, updates: Updates, *, inplace: bool = False, donate_updates: bool = False) -> Params:
    """Returns ``params + updates``, each result cast back to its parameter's dtype.

    The sum is taken in the promoted dtype and rounded once into the parameter's (as optax's
    ``(p + u).astype(p.dtype)`` and torch's ``p.add_(u)`` do), so a float32 update to a bfloat16
    parameter is not rounded to bfloat16 before it is added.

    Pure by default: neither tree is modified. With ``inplace=True`` the parameters are updated in
    place (as a torch optimizer's ``step`` does) and the same tree is returned. With
    ``donate_updates=True`` the caller gives up ``updates`` (the fresh output of a pure ``update``,
    say): each sum is written into its update's buffer where that buffer has the parameter's dtype,
    device and strides, and the new parameters are those buffers; ``params`` are still left alone,
    so the step stays pure and allocates no new parameter tree. Same numbers on every path.
    A ``None`` update leaves its parameter as it is. The trees must have the same structure; a
    mismatch is a ``ValueError`` naming the first differing path.
    """
    param_leaves, update_leaves, treedef, pairs = paired_leaves(params, updates, owner="apply_updates")
    new_leaves = list(param_leaves)
    if pairs:
        params_list = [param_leaves[i] for i in pairs]
        updates_list = tree_lib.to_devices([update_leaves[i] for i in pairs], params_list)
        into_updates = donate_updates and not inplace and not tree_lib.needs_graph(params_list, updates_list)
        for indices, (group_params, group_updates) in tree_lib.grouped(params_list, updates_list):
            if into_updates:
                summed = _sum_into_updates(group_params, group_updates)
            elif not inplace and packing.wanted([group_params, group_updates]):
                # new params: many small ones are summed packed into one (the same sums, fewer calls)
                (summed,) = packing.map_packed(lambda p, u: (_new_sums(p, u),), [group_params, group_updates], 1)
            elif not inplace and not tree_lib.needs_graph(group_params, group_updates):
                summed = _new_sums(group_params, group_updates)
            else:
                summed = tree_lib.foreach_add(group_params, group_updates, inplace=inplace)
            if inplace:  # where a graph is recorded the sums are new tensors: write them back
                summed = [p if v is p else p.copy_(v) for p, v in zip(group_params, summed)]
            dtype = group_params[0].dtype
            for i, value in zip(indices, summed):
                new_leaves[pairs[i]] = value if value.dtype == dtype else value.to(dtype)
    return params if inplace else tree_lib.unflatten(treedef, new_leaves)


def _new_sums(params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params + updates`` of one (device, dtype) group as new tensors, the large CPU ones written
    into buffers recycled from earlier steps' new params (:func:`gradtx.buffer_pool.new_like`), so
    a pure step does not fault a new params tree in; the same sums as ``foreach_add``."""
    pooled = [  # laid out row-major, as the sum of two such tensors is (strides of size-1 dims too)
        i for i, (p, u) in enumerate(zip(params, updates))
        if u.dtype == p.dtype and u.layout == torch.strided and u.shape == p.shape and buffer_pool.poolable(p)
        and p.stride() == u.stride() == buffer_pool.row_major(p.shape)
    ]
    if not pooled:
        return tree_lib.foreach_add(params, updates, inplace=False)
    from gradtx.native.add import add_into  # the float32 CPU sums stored past the cache

    out: list[Any] = [None] * len(params)
    for i, buffer in zip(pooled, buffer_pool.new_like([params[i] for i in pooled], "apply_updates")):
        out[i] = add_into(params[i], updates[i], buffer)
    others = [i for i in range(len(params)) if out[i] is None]
    if others:
        for i, value in zip(others, tree_lib.foreach_add([params[i] for i in others], [updates[i] for i in others], inplace=False)):
            out[i] = value
    return out


def _sum_into_updates(params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params + updates`` of one (device, dtype) group of params, each sum in its donated update's
    buffer where that buffer fits the parameter (dtype, strides), else in a new tensor.

    ``u + p`` is ``p + u`` bit for bit (a float sum commutes), so the numbers are the pure path's.
    """
    fits = [u.dtype == p.dtype and u.stride() == p.stride() and u is not p for p, u in zip(params, updates)]
    if all(fits):
        torch_internals.foreach_kernel("add_")(updates, params)
        return updates
    out = list(updates)
    chosen = [i for i, fit in enumerate(fits) if fit]
    if chosen:
        torch_internals.foreach_kernel("add_")([updates[i] for i in chosen], [params[i] for i in chosen])
    others = [i for i, fit in enumerate(fits) if not fit]
    for i, value in zip(others, tree_lib.foreach_add([params[i] for i in others], [updates[i] for i in others])):
        out[i] = value
    return out
