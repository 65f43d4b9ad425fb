"""Monitoring: record a measurement of the updates into the state, for logging.

``chain(sgd(0.1), snapshot("update_norm", global_norm), clip_by_global_norm(1.0))`` keeps the norm
of the updates as they reach that point of the chain; ``get_measurement(state, "update_norm")``
finds it in the whole chain's state. ``monitor`` records several measurements at once, some of
them stateful (``measure_with_ema``). As optax's ``snapshot`` / ``monitor`` / ``measure_with_ema``;
the updates pass through unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import torch
from torch import Tensor

from gradtx import tree as tree_lib
from gradtx.base import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    init_empty_state,
    takes_extra_args,
    with_inplace,
)
from gradtx.chains._select import counter, safe_increment
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_check import named

PyTree = Any
Measure = Callable[[PyTree], PyTree]


class SnapshotState(NamedTuple):
    """``measurement``: ``{measure_name: measure(updates)}`` from the last update."""

    measurement: dict[str, Any]


class MonitorState(NamedTuple):
    """``measurements``: name -> last measurement; ``measure_states``: the stateful measures' states."""

    measurements: dict[str, Any]
    measure_states: tuple




def _detached_from(measurement: PyTree, updates: PyTree) -> PyTree:
    """``measurement`` with any tensor sharing memory with ``updates`` cloned.

    On the donated path later transformations overwrite the updates in place; a measurement that
    is (a view of) an update must not change with them.
    """
    shared = dtensor_lib.storage_pointers(tree_lib.leaves(updates))
    if not shared:
        return measurement

    def own(x: Any) -> Any:
        if isinstance(x, Tensor) and dtensor_lib.storage_pointers([x]) & shared:
            return x.clone()
        return x

    return tree_lib.tree_map(own, measurement)


def snapshot(measure_name: str, measure: Measure) -> GradientTransformation:
    """Stores ``measure(updates)`` in the state under ``measure_name``; the updates pass unchanged.

    ``init`` stores ``measure(params)`` so the state has its final structure from the start.
    """

    def init_fn(params: PyTree) -> SnapshotState:
        return SnapshotState({measure_name: measure(params)})

    def update_fn(updates, state, params=None, *, inplace=False):
        del state, params
        measurement = measure(updates)
        if inplace:
            measurement = _detached_from(measurement, updates)
        return updates, SnapshotState({measure_name: measurement})

    return GradientTransformation(init_fn, update_fn)


class EmaMeasureState(NamedTuple):
    """``count``: measurements averaged so far (0-d int32); ``ema``: their moving average."""

    count: Tensor
    ema: PyTree


def measure_with_ema(
    measure: Measure, decay: float, debias: bool = True, accumulator_dtype: Optional[torch.dtype] = None
) -> GradientTransformation:
    """A stateful measure for :func:`monitor`: the exponential moving average of ``measure(updates)``.

    ``ema = decay * ema + (1 - decay) * m``, divided by ``1 - decay ** count`` when ``debias``.
    Its output (the "updates" it returns) is the measurement; bools are averaged as 0/1.
    ``accumulator_dtype`` defaults to float32 (float64 kept).
    """
    decay = float(decay)

    def dtype_of(x: Tensor) -> torch.dtype:
        if accumulator_dtype is not None:
            return accumulator_dtype
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def as_tensor_tree(tree: PyTree) -> PyTree:
        return tree_lib.tree_map(lambda x: torch.as_tensor(x), tree)

    def init_fn(params: PyTree) -> EmaMeasureState:
        shape = as_tensor_tree(measure(params))
        return EmaMeasureState(
            count=counter(params), ema=tree_lib.tree_map(lambda x: torch.zeros_like(x, dtype=dtype_of(x)), shape)
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params, inplace
        values = as_tensor_tree(measure(updates))
        count = safe_increment(state.count)
        ema = tree_lib.tree_map(lambda e, m: e * decay + m.to(e.dtype) * (1.0 - decay), state.ema, values)
        out = ema
        if debias:
            correction = 1.0 - decay ** count.to(torch.float64)
            out = tree_lib.tree_map(lambda e: e / correction.to(device=e.device, dtype=e.dtype), ema)
        return out, EmaMeasureState(count=count, ema=ema)

    return GradientTransformation(init_fn, update_fn)


def monitor(measures: Mapping[str, Union[Measure, GradientTransformation]]) -> GradientTransformation:
    """Records several measurements of the updates at once; the updates pass unchanged.

    Args:
      measures: name -> a callable ``updates -> measurement``, or a transformation whose output is
        the measurement and whose state carries between steps (:func:`measure_with_ema`).

    Measuring transformations run on their pure path, whatever ``inplace`` says: the updates they
    see go on down the chain. ``init`` records the measurements of the params (with a throwaway
    state), so the state has its final structure from the start. Extra arguments given to
    ``update`` reach the measuring transformations that take them (``GradientTransformationExtraArgs``,
    which the result then is too); ``init`` calls them without any, so they need defaults.
    """
    names = tuple(measures)
    as_transforms: dict[str, GradientTransformation] = {}
    for name, measure in measures.items():
        if isinstance(measure, GradientTransformation):
            as_transforms[name] = measure
        elif callable(measure):
            as_transforms[name] = _measuring(measure)
        else:
            raise TypeError(f"monitor: measure {name!r} is a {type(measure).__name__}, expected a callable")
    updaters = {name: with_inplace(tx) for name, tx in as_transforms.items()}
    takes_extra = {name: takes_extra_args(tx) for name, tx in as_transforms.items()}

    def init_fn(params: PyTree) -> MonitorState:
        states = tuple(as_transforms[name].init(params) for name in names)
        measurements = {
            name: updaters[name](params, as_transforms[name].init(params), params, inplace=False)[0] for name in names
        }
        return MonitorState(measurements, states)

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        measurements, states = {}, []
        for name, measure_state in zip(names, state.measure_states):
            forwarded = extra_args if takes_extra[name] else {}
            measurement, new_state = updaters[name](updates, measure_state, params, inplace=False, **forwarded)
            measurements[name] = _detached_from(measurement, updates) if inplace else measurement
            states.append(new_state)
        return updates, MonitorState(measurements, tuple(states))

    return (GradientTransformationExtraArgs if any(takes_extra.values()) else GradientTransformation)(init_fn, update_fn)


def _measuring(measure: Measure) -> GradientTransformation:
    """A stateless measuring transformation: its output is ``measure(updates)``."""


    def update_fn(updates, state, params=None, *, inplace=False):
        del params, inplace
        return measure(updates), state

    return GradientTransformation(init_empty_state, named(update_fn, "monitor"))


def get_measurement(state: PyTree, name: str) -> Any:
    """Finds the measurement ``name`` recorded by a :func:`snapshot` or :func:`monitor` anywhere in ``state``.

    Raises ``KeyError`` when no such measurement is recorded.
    """
    found = _find(state, name)
    if found is _MISSING:
        raise KeyError(f"get_measurement: no snapshot or monitor in the state records {name!r}")
    return found


_MISSING = object()


def _find(node: Any, name: str) -> Any:
    if isinstance(node, SnapshotState) and name in node.measurement:
        return node.measurement[name]
    if isinstance(node, MonitorState) and name in node.measurements:
        return node.measurements[name]
    if isinstance(node, Mapping):
        children = list(node.values())
    elif isinstance(node, (tuple, list)):
        children = list(node)
    else:
        return _MISSING
    for child in children:
        found = _find(child, name)
        if found is not _MISSING:
            return found
    return _MISSING
