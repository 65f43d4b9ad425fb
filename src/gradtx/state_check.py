"""A transformation's ``update`` is checked against the state its ``init`` makes.

Every :class:`~gradtx.GradientTransformation` is built with its ``update`` wrapped here, so a state
the transformation did not make (``None``, another transformation's state, a chain's tuple of
another length, a state built for other params) is a ``TypeError`` or ``ValueError`` naming the
transformation, the place in the state, and what is there against what ``init`` makes, instead of
an ``AttributeError`` or a broadcast error from deep inside a kernel.

A step pays one type comparison per transformation:

- Up front, a state of another type than the one ``init`` returned (learned when ``init`` runs,
  or known when the transformation is built) is a ``TypeError``, before the update runs and so
  before any collective. ``None`` passes: a transformation that reads no state (``scale``,
  ``clip_by_global_norm``) takes it, as ``torch.nn.utils.clip_grad_norm_`` needs none; one that
  reads its state fails on it, below.
- When ``update`` raises, the state is compared with what ``init`` makes for the params at hand
  (on the meta device where ``init`` runs there: no memory, no numbers; random generators are left
  as they were), and the first difference is raised in place of the error, which is chained to it.
  A state whose leaves have other shapes is found there, on its first use. Under
  ``torch.distributed`` with several ranks, where an ``init`` may run collectives, ``init`` is not
  called and only the learned type is compared.

Leaf shapes are not compared on a step that succeeds: on 10,000 small leaves that pass would cost
a few percent of the step. A state whose shapes broadcast against the updates (a ``(1,)`` moment
for a ``(4,)`` parameter) thus goes through.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from gradtx import tree as tree_lib

_CHECKED = "_gradtx_checked_update"
_KNOWN = "_gradtx_state_type"
_NAME = "_gradtx_name"
_SEEN = "_gradtx_state_examined"


# --------------------------------------------------------------------------- names


def named(update_fn: Callable, name: str) -> Callable:
    """Gives ``update_fn`` the name its errors use (``"adamw"``), and returns it.

    Without one, the name is that of the function the update was defined in (``scale_by_adam``
    for the ``update_fn`` inside ``scale_by_adam``), which is the factory the user called.
    """
    setattr(update_fn, _NAME, name)
    return update_fn


def name_of(update_fn: Callable) -> str:
    """The name of the transformation ``update_fn`` belongs to, for error messages: the one given
    by :func:`named`, else the function ``update_fn`` was defined in, else its class or its own name."""
    explicit = getattr(update_fn, _NAME, None)
    if explicit:
        return explicit
    qualname = getattr(update_fn, "__qualname__", None) or type(update_fn).__qualname__
    scopes = qualname.split(".<locals>.")
    head = scopes[-2].rpartition(".")[2] if len(scopes) > 1 else scopes[0].partition(".")[0]
    return head if head.isidentifier() else "GradientTransformation"


# --------------------------------------------------------------------------- descriptions


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _article(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _value(value: Any) -> str:
    """What a state (or part of one) is, in words: ``"None"``, ``"a ScaleByAdamState"``, ``"a tuple of 3"``."""
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if _is_namedtuple(value):
        return _article(type(value).__name__)
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return _article(type(value).__name__)


def _type(kind: type) -> str:
    if kind is type(None):
        return "None"
    return _article(kind.__name__)


def _fits(value: Any, kind: type) -> bool:
    """Whether a state of type ``kind`` may be given as ``value``: the same type, or a plain
    container of the same kind (a list for a tuple, an ``OrderedDict`` for a dict)."""
    if type(value) is kind:
        return True
    if hasattr(kind, "_fields"):  # a NamedTuple state (an empty tuple is taken for an EmptyState)
        return isinstance(value, kind) or (not kind._fields and type(value) is tuple and not value)
    if kind in (tuple, list):
        return isinstance(value, (tuple, list)) and not _is_namedtuple(value)
    if issubclass(kind, dict):
        return isinstance(value, dict)
    if issubclass(kind, Tensor):
        return isinstance(value, Tensor)
    if kind in (bool, int, float):
        return isinstance(value, (bool, int, float, Tensor))
    return isinstance(value, kind)


def _hint(given: Any, expected: type) -> str:
    """A guess at how a user came to pass ``given`` where a state of type ``expected`` was wanted."""
    plain_given = isinstance(given, (tuple, list)) and not _is_namedtuple(given)
    if plain_given and hasattr(expected, "_fields"):
        return " (a chain's tuple of states? each member takes its own entry)"
    if expected in (tuple, list) and _is_namedtuple(given):
        return " (one member's state? a chain takes the tuple of every member's state)"
    if _is_namedtuple(given):
        return " (another transformation's state?)"
    return ""


def describe_state(
    state: Any, expected: Any, where: str = "state", *, made_for: str = "these params"
) -> Optional[tuple[type, str]]:
    """The first place where ``state`` differs from ``expected``, what the transformation's ``init``
    makes for the params at hand (``made_for`` names them in messages): ``(TypeError or ValueError,
    message)``, or ``None`` where they agree.

    Containers are compared by kind and entries, tensors by shape (not dtype or device: a state
    may be cast or moved). A place where ``expected`` holds ``None`` takes anything.
    """
    if expected is None:
        return None
    if not _fits(state, type(expected)):
        hint = _hint(state, type(expected))
        return TypeError, f"{where} is {_value(state)}, where init makes {_value(expected)}{hint}"
    if isinstance(expected, Tensor):
        if state.shape != expected.shape:
            return ValueError, (
                f"{where} has shape {tuple(state.shape)}, where init makes {tuple(expected.shape)} for {made_for} "
                "(was the state built for params of other shapes?)"
            )
        return None
    if isinstance(expected, dict):
        missing = [k for k in expected if k not in state]
        extra = [k for k in state if k not in expected]
        if missing or extra:
            parts = [f"lacks {_keys(missing)} that init makes for {made_for}"] if missing else []
            parts += [f"has {_keys(extra)} that init makes no entry for"] if extra else []
            return ValueError, f"{where} {'; it '.join(parts)} (was the state built for other params?)"
        children = [(f"{where}[{key!r}]", state[key], value) for key, value in expected.items()]
    elif isinstance(expected, (tuple, list)):
        if len(state) != len(expected):
            return ValueError, f"{where} is {_value(state)}, where init makes {_value(expected)}"
        fields = getattr(type(expected), "_fields", None)
        children = [
            (f"{where}.{fields[i]}" if fields else f"{where}[{i}]", given, value)
            for i, (given, value) in enumerate(zip(state, expected))
        ]
    else:
        return None
    for path, given, value in children:
        found = describe_state(given, value, path, made_for=made_for)
        if found is not None:
            return found
    return None


def _keys(keys: list[Any]) -> str:
    named = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"{'key' if len(keys) == 1 else 'keys'} {named}"


# --------------------------------------------------------------------------- the check


def examined(error: Exception) -> Exception:
    """``error``, marked as saying itself what is wrong with the state it was raised for: the check
    passes it on instead of describing the state's first difference from what ``init`` makes."""
    setattr(error, _SEEN, True)
    return error


def _check_type(owner: str, state: Any, kind: type) -> None:
    """Raises a ``TypeError`` for a state that cannot stand for one of type ``kind`` (what ``init`` returns)."""
    if _fits(state, kind):
        return
    raise examined(TypeError(f"{owner}: state is {_value(state)}, where init makes {_type(kind)}{_hint(state, kind)}"))


def _distributed() -> bool:
    """Whether this process is one of several ranks (then ``init`` may run collectives)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_UNKNOWN = object()


def _made_by(init: Callable, tree: Any) -> Any:
    """What ``init`` makes for params shaped like ``tree``: built on the meta device (no memory, no
    numbers), or, for an init that needs real tensors (a random generator on their device, a
    ``.item()``), on ``tree`` itself; the random generators are left as they were. ``_UNKNOWN``
    when it cannot be told."""
    if tree is None or _distributed():  # an init may reduce over ranks: never from one rank alone
        return _UNKNOWN

    def on_meta(leaf: Any) -> Any:
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta") if isinstance(leaf, Tensor) else leaf

    cuda = sorted({leaf.get_device() for leaf in tree_lib.leaves(tree) if isinstance(leaf, Tensor) and leaf.is_cuda})
    for make in (lambda: tree_lib.tree_map(on_meta, tree), lambda: tree):
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                return init(make())
        except Exception:  # noqa: BLE001 - nothing to compare with: the original error stands
            continue
    return _UNKNOWN


def _explain(
    error: Exception, owner: str, init: Callable, kind: Optional[type], state: Any, updates: Any, params: Any
) -> None:
    """Raises the state's first difference from what ``init`` makes, if there is one, in place of ``error``."""
    if torch.compiler.is_compiling() or getattr(error, _SEEN, False):
        return  # explained already, by the transformation it arose in
    if state is None and "NoneType" not in str(error):
        return  # a None state is taken where it is not read: the error is about something else
    expected = _made_by(init, params if params is not None else updates)
    if expected is not _UNKNOWN:
        made_for = "these params" if params is not None else "updates of these shapes"
        found = describe_state(state, expected, made_for=made_for)
    elif state is None and kind is not None and kind is not type(None):
        found = (TypeError, f"state is None, where init makes {_type(kind)}")
    else:
        found = None
    if found is None:
        return
    error_type, message = found
    new_error = error_type(f"{owner}: {message}")
    setattr(new_error, _SEEN, True)
    raise new_error from error


def checked(init: Callable, update: Callable, *, state_type: Optional[type] = None) -> tuple[Callable, Callable]:
    """``(init, update)`` with the state checks described above. ``state_type``: the type ``init``
    returns, where it is known without calling it (``EmptyState``). An update already checked is
    returned as it is, with ``init``; an ``init`` already checked is kept, and the type it learns
    serves both updates."""
    if getattr(update, _CHECKED, False) or not callable(update) or not callable(init):
        return init, update
    owner = name_of(update)
    known: Optional[list[Optional[type]]] = getattr(init, _KNOWN, None)
    if known is not None:  # another transformation's checked init, reused: it learns for both
        init_fn = init
    else:
        known = [state_type]

        @functools.wraps(init)
        def init_fn(params):
            state = init(params)
            known[0] = type(state)
            return state

        setattr(init_fn, _KNOWN, known)

    def with_checks(run: Callable) -> Callable:
        @functools.wraps(run)
        def checked_run(updates, state, *args, **kwargs):
            kind = known[0]
            if kind is not None and type(state) is not kind and state is not None:
                _check_type(owner, state, kind)
            try:
                return run(updates, state, *args, **kwargs)
            except Exception as error:
                _explain(error, owner, init, kind, state, updates, args[0] if args else kwargs.get("params"))
                raise

        return checked_run

    update_fn = with_checks(update)
    from gradtx.base import scaled_update_of, takes_scaled_gradients  # here: gradtx.base imports this module

    scaled_update = scaled_update_of(update)
    if scaled_update is not None:  # the same checks on the way a chain hands it a clip's coefficient
        takes_scaled_gradients(update_fn, with_checks(scaled_update))
    handed_factor = getattr(update, "handed_factor", None)
    if handed_factor is not None:  # and on the clip's side of that hand-off, before its norm's collective
        update_fn.handed_factor = with_checks(handed_factor)  # type: ignore[attr-defined]
    setattr(update_fn, _CHECKED, True)
    return init_fn, update_fn
