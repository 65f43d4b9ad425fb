"""A transformation given a state it did not make says so: which transformation, where in the state,
and what it found against what its ``init`` makes.

Every public transformation and combinator (the catalogue of ``test_state_storage``) is given
``None``, another transformation's state, and a state built for params of other shapes. Each one
either raises a ``TypeError`` or ``ValueError`` naming itself and the place, or (``None`` only, for
those that read no state) gives the numbers the right state gives.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import gradtx as gtx
from gradtx import state_check
import test_state_storage as catalogue

# Transformations whose update never reads its state: ``None`` is taken as "no state", as torch's
# ``clip_grad_norm_`` needs none. Every other transformation raises on ``None``.
READS_NO_STATE = {
    "adaptive_grad_clip", "add_decayed_weights", "centralize", "clip", "clip_by_block_rms", "clip_by_global_norm",
    "clip_by_value", "contrib.normalize", "identity", "keep_params_nonnegative", "normalize_by_update_norm",
    "scale", "scale_by_param_block_norm", "scale_by_param_block_rms", "scale_by_sign", "scale_by_trust_ratio",
    "set_to_zero", "snapshot", "stateless", "stateless_with_tree_map",
}
NAMES = sorted(catalogue.CASES)
OTHER_SHAPES = {name: tuple(n + 1 for n in shape) for name, shape in catalogue.SHAPES.items()}


def _grads(name: str) -> dict:
    return catalogue.grads(0, (2,) if name in catalogue.PER_EXAMPLE else ())


def _step(name: str, tx, state, params, *, good_state):
    """One update of case ``name`` with ``state``; the objective's arguments come from ``good_state``."""
    grads, extra = _grads(name), {}
    if name in catalogue.EXTRA_ARGS:
        grads, extra = catalogue.extra_args(name, params, good_state)
    return tx.update(grads, state, params, **extra)


def _foreign_state(state) -> object:
    """A state of another transformation than the one that made ``state``."""
    for other in (gtx.scale_by_adam(), gtx.trace(0.9)):
        candidate = other.init(catalogue.params())
        if type(candidate) is not type(state):
            return candidate
    raise AssertionError("unreachable")


@pytest.fixture()
def built(monkeypatch) -> set:
    """The names of every transformation built while the test runs (an error must name one of them)."""
    names: set = set()
    checked = state_check.checked

    def spy(init, update, **kwargs):
        names.add(state_check.name_of(update))
        return checked(init, update, **kwargs)

    monkeypatch.setattr(state_check, "checked", spy)
    return names


def _owner(message: str, built: set) -> str:
    """The transformation an error names (what comes before the first ``": "``), checked to be one of ``built``."""
    owner = message.split(": ", 1)[0]
    assert owner in built, f"{message!r} names {owner!r}, not one of {sorted(built)}"
    return owner


def _shapes(tree) -> list:
    return [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else leaf for leaf in gtx.tree.leaves(tree)]


@pytest.mark.parametrize("name", NAMES)
def test_none_is_a_type_error_naming_the_transformation(name, built):
    tx, params = catalogue.CASES[name](), catalogue.params()  # never initialised: the error explains itself
    good_state = catalogue.CASES[name]().init(params)
    if name in READS_NO_STATE:
        updates, _ = _step(name, tx, None, params, good_state=good_state)
        expected, _ = _step(name, catalogue.CASES[name](), good_state, params, good_state=good_state)
        torch.testing.assert_close(updates, expected)
        return
    with pytest.raises(TypeError, match=r"^[^:]+: state(\S*) is None, where init makes ") as info:
        _step(name, tx, None, params, good_state=good_state)
    _owner(str(info.value), built)


@pytest.mark.parametrize("name", NAMES)
def test_another_transformations_state_is_a_type_error_naming_both_types(name):
    tx, params = catalogue.CASES[name](), catalogue.params()
    good_state = tx.init(params)
    foreign = _foreign_state(good_state)
    owner = state_check.name_of(tx.update)
    expected = rf"^{re.escape(owner)}: state is an? {type(foreign).__name__}, where init makes an? {type(good_state).__name__}"
    with pytest.raises(TypeError, match=expected):
        _step(name, tx, foreign, params, good_state=good_state)


def _state_for_other_shapes(name: str):
    """The state ``name`` makes for params of ``OTHER_SHAPES``, or None when its shapes do not depend on the params'."""
    params = catalogue.params()
    wrong = catalogue.CASES[name]().init({k: torch.randn(OTHER_SHAPES[k]) for k in params})
    return None if _shapes(wrong) == _shapes(catalogue.CASES[name]().init(params)) else wrong


SHAPED_NAMES = [name for name in NAMES if _state_for_other_shapes(name) is not None]


@pytest.mark.parametrize("name", SHAPED_NAMES)
def test_a_state_for_other_shapes_names_the_leaf_and_both_shapes(name, built):
    tx, params = catalogue.CASES[name](), catalogue.params()
    good_state = catalogue.CASES[name]().init(params)
    wrong = _state_for_other_shapes(name)
    try:
        _, new_state = _step(name, tx, wrong, params, good_state=good_state)
    except ValueError as error:
        message = str(error)
        found = re.match(
            r"^[^:]+: state(?P<path>\S*) has shape (?P<given>\([\d, ]*\)), "
            r"where init makes (?P<made>\([\d, ]*\)) for (these params|updates of these shapes)",
            message,
        )
        assert found and found["given"] != found["made"], message
        keys = re.findall(r"\['([\w.]+)'\]", found["path"])
        assert name == "flatten" or set(keys) & set(params), message  # flatten's state is one flat vector
        _owner(message, built)
    else:
        # a state the update never reads (a line search's stored gradient) is replaced, not used
        assert state_check.describe_state(new_state, catalogue.CASES[name]().init(params)) is None


@pytest.mark.parametrize("name", NAMES)
def test_a_state_the_transformation_made_is_never_blamed(name):
    """The comparison behind the errors finds nothing wrong in a state the transformation made, after steps."""
    tx, params = catalogue.CASES[name](), catalogue.params()
    state = tx.init(params)
    for step in range(2):
        grads, extra = catalogue.grads(step, (2,) if name in catalogue.PER_EXAMPLE else ()), {}
        if name in catalogue.EXTRA_ARGS:
            grads, extra = catalogue.extra_args(name, params, state)
        updates, state = tx.update(grads, state, params, **extra)
        assert state_check.describe_state(state, state_check._made_by(tx.init, params)) is None
        if name != "measure_with_ema":
            params = gtx.apply_updates(params, updates)


# --------------------------------------------------------------------------- chains


def _chain():
    return gtx.chain(gtx.clip_by_global_norm(1.0), gtx.trace(0.9), gtx.scale_by_adam())


def test_a_chain_given_a_tuple_of_another_length_says_how_many_it_makes():
    tx, params = _chain(), catalogue.params()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"^chain\(clip_by_global_norm, trace, scale_by_adam\): "
                                         r"state is a tuple of 2, where init makes a tuple of 3"):
        tx.update(catalogue.grads(0), state[1:], params)


def test_a_member_given_another_members_state_names_the_member():
    tx, params = _chain(), catalogue.params()
    clip, trace, adam = tx.init(params)
    with pytest.raises(TypeError, match=r"^trace: state is a ScaleByAdamState, where init makes a TraceState "
                                        r"\(another transformation's state\?\)"):
        tx.update(catalogue.grads(0), (clip, adam, trace), params)


def test_a_chain_given_one_members_state_and_a_member_given_the_chains_tuple():
    tx, params = _chain(), catalogue.params()
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"state is a TraceState, where init makes a tuple \(one member's state\?"):
        tx.update(catalogue.grads(0), state[1], params)
    adam = gtx.scale_by_adam()
    adam.init(params)
    with pytest.raises(TypeError, match=r"^scale_by_adam: state is a tuple of 3, where init makes a ScaleByAdamState "
                                        r"\(a chain's tuple of states\?"):
        adam.update(catalogue.grads(0), state, params)


def test_a_state_for_other_params_names_the_missing_key():
    tx = gtx.sgd(0.1, momentum=0.9)
    params = catalogue.params()
    state = tx.init({k: v for k, v in params.items() if k != "head.weight"})
    with pytest.raises(ValueError, match=r"^sgd: state\[0\]\.trace lacks key 'head.weight' that init makes for these params"):
        tx.update(catalogue.grads(0), state, params)


def test_optimizers_name_themselves_or_their_members():
    params = catalogue.params()
    with pytest.raises(TypeError, match=r"^adamw: state is None, where init makes a tuple of 3$"):
        gtx.adamw(1e-3).update(catalogue.grads(0), None, params)
    with pytest.raises(TypeError, match=r"^sgd: state is None, where init makes a tuple of 2$"):
        gtx.sgd(0.1, momentum=0.9).update(catalogue.grads(0), None, params)


def test_multisteps_checks_calls_on_the_object_too():
    steps = gtx.MultiSteps(gtx.scale_by_adam(), 2)
    with pytest.raises(TypeError, match=r"^MultiSteps: state is None, where init makes a MultiStepsState"):
        steps.update(catalogue.grads(0), None, catalogue.params())


# --------------------------------------------------------------------------- what the check leaves alone


def test_errors_that_are_not_about_the_state_pass_through_unchanged():
    tx, params = gtx.adamw(1e-3), catalogue.params()
    with pytest.raises(ValueError, match=r"^adamw: params are required for weight decay"):
        tx.update(catalogue.grads(0), tx.init(params))
    with pytest.raises(ValueError, match=r"^adaptive_grad_clip: params are required"):
        gtx.adaptive_grad_clip(0.1).update(catalogue.grads(0), None)


def test_the_original_error_is_chained():
    tx, params = gtx.scale_by_adam(), catalogue.params()
    wrong = tx.init({k: torch.zeros(OTHER_SHAPES[k]) for k in params})
    with pytest.raises(ValueError) as info:
        tx.update(catalogue.grads(0), wrong, params)
    assert isinstance(info.value.__cause__, RuntimeError)  # the kernel's broadcast error


def _noisy_scale() -> gtx.GradientTransformation:
    """Scales by a random number drawn at init, read on the host (so its init cannot run on meta tensors)."""

    def init(params):
        scale = float(torch.rand(()))
        return {name: torch.full_like(p, scale) for name, p in params.items()}

    def update(updates, state, params=None):
        return {name: g * state[name] for name, g in updates.items()}, state

    return gtx.GradientTransformation(init, update)


def test_explaining_an_error_leaves_the_random_generators_alone():
    """An init that cannot run on the meta device runs on the real params, its random draws undone,
    so a caller that catches the error sees the random numbers it would have seen."""
    tx, params = _noisy_scale(), catalogue.params()
    wrong = tx.init({k: torch.zeros(OTHER_SHAPES[k]) for k in params})
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"^_noisy_scale: state\['layer.weight'\] has shape \(5, 4\), where init makes \(4, 3\)"):
        tx.update(catalogue.grads(0), wrong, params)
    assert torch.equal(torch.rand(3), expected)


def test_a_user_transformation_is_named_after_its_factory():
    def my_optimizer():
        def init_fn(params):
            return gtx.TraceState(trace=dict(params))

        def update_fn(updates, state, params=None):
            return {k: g + state.trace[k] for k, g in updates.items()}, state

        return gtx.GradientTransformation(init_fn, update_fn)

    tx = my_optimizer()
    with pytest.raises(TypeError, match=r"^my_optimizer: state is None, where init makes a TraceState"):
        tx.update(catalogue.grads(0), None)


def test_the_update_keeps_its_signature_and_marks():
    tx = gtx.clip_by_global_norm(1.0)
    assert gtx.base.takes_donated_updates(tx) and tx.update.sharding_spec is None
    assert "inplace" in inspect.signature(tx.update).parameters
    assert gtx.chain(tx).init.__name__ == "init_fn"
