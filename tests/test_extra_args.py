"""Extra arguments (``value=``, ``grad=``, ``value_fn=``, ...): who receives them, through every combinator."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import gradtx as gtx


class Seen(NamedTuple):
    calls: torch.Tensor


def recording(log: list, tag: str = "rec") -> gtx.GradientTransformationExtraArgs:
    """An ExtraArgs member that records the extra arguments it receives and scales by ``value``."""

    def init_fn(params):
        return Seen(torch.zeros((), dtype=torch.int64))

    def update_fn(updates, state, params=None, *, inplace=False, value=None, **extra_args):
        log.append((tag, value, dict(extra_args)))
        factor = 1.0 if value is None else float(value)
        return {k: None if u is None else u * factor for k, u in updates.items()}, Seen(state.calls + 1)

    return gtx.GradientTransformationExtraArgs(init_fn, update_fn)


def plain(log: list) -> gtx.GradientTransformation:
    """A plain member written optax-style: no ``inplace``, no ``**extra_args``."""

    def update_fn(updates, state, params=None):
        log.append(("plain",))
        return updates, state

    return gtx.GradientTransformation(gtx.init_empty_state, update_fn)


def strict_plain(log: list) -> gtx.GradientTransformation:
    """A plain member with ``inplace`` but no ``**extra_args``: an extra argument would raise TypeError."""

    def update_fn(updates, state, params=None, *, inplace=False):
        log.append(("strict",))
        return updates, state

    return gtx.GradientTransformation(gtx.init_empty_state, update_fn)


def optax_style_extra(log: list) -> gtx.GradientTransformationExtraArgs:
    """An ExtraArgs member written as in optax: ``(updates, state, params=None, **extra_args)``."""

    def update_fn(updates, state, params=None, **extra_args):
        log.append(("optax", dict(extra_args)))
        return updates, state

    return gtx.GradientTransformationExtraArgs(gtx.init_empty_state, update_fn)


PARAMS = {"w": torch.ones(3), "b": torch.ones(2)}
GRADS = {"w": torch.full((3,), 2.0), "b": torch.full((2,), 3.0)}


def run(tx, **extra):
    state = tx.init(PARAMS)
    return tx.update(GRADS, state, PARAMS, **extra)


def test_extra_args_kind_is_a_gradient_transformation():
    log: list = []
    tx = recording(log)
    assert isinstance(tx, gtx.GradientTransformation)
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    assert not isinstance(plain(log), gtx.GradientTransformationExtraArgs)
    init, update = tx  # still the (init, update) pair
    assert init is tx.init and update is tx.update


def test_chain_forwards_only_to_members_that_take_them():
    log: list = []
    tx = gtx.chain(strict_plain(log), recording(log), plain(log), optax_style_extra(log))
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    updates, state = run(tx, value=torch.tensor(0.5), x="data")
    assert log[0] == ("strict",)
    assert log[1][0] == "rec" and float(log[1][1]) == 0.5 and log[1][2] == {"x": "data"}
    assert log[2] == ("plain",)
    # the optax-style member receives the extra arguments and nothing else (no ``inplace``)
    assert log[3] == ("optax", {"value": torch.tensor(0.5), "x": "data"})
    torch.testing.assert_close(updates["w"], GRADS["w"] * 0.5)
    assert int(state[1].calls) == 1


def test_chain_kind_follows_its_members():
    log: list = []
    assert not isinstance(gtx.chain(strict_plain(log), gtx.scale(2.0)), gtx.GradientTransformationExtraArgs)
    assert isinstance(gtx.chain(gtx.scale(2.0), recording(log)), gtx.GradientTransformationExtraArgs)
    # nested chains flatten and keep forwarding
    nested = gtx.chain(gtx.scale(2.0), gtx.chain(plain(log), recording(log)))
    assert isinstance(nested, gtx.GradientTransformationExtraArgs)
    updates, _ = run(nested, value=3.0)
    torch.testing.assert_close(updates["b"], GRADS["b"] * 6.0)


def test_plain_chain_accepts_and_ignores_extra_args():
    log: list = []
    tx = gtx.chain(strict_plain(log), plain(log))
    updates, _ = run(tx, value=1.0, grad=GRADS)
    assert log == [("strict",), ("plain",)]
    torch.testing.assert_close(updates, GRADS)


def test_with_extra_args_support():
    log: list = []
    base = strict_plain(log)
    adapted = gtx.with_extra_args_support(base)
    assert isinstance(adapted, gtx.GradientTransformationExtraArgs)
    assert adapted.init is base.init
    updates, _ = adapted.update(GRADS, adapted.init(PARAMS), PARAMS, value=1.0, anything="x")
    assert log == [("strict",)]
    torch.testing.assert_close(updates, GRADS)
    rec = recording(log)
    assert gtx.with_extra_args_support(rec) is rec


def test_named_chain_forwards():
    log: list = []
    tx = gtx.named_chain(("a", strict_plain(log)), ("b", recording(log)))
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    updates, state = run(tx, value=2.0)
    assert float(state["b"].calls) == 1
    torch.testing.assert_close(updates["w"], GRADS["w"] * 2.0)


def test_masked_forwards_and_masks_compatible_extra_args():
    log: list = []
    mask = {"w": True, "b": False}
    tx = gtx.masked(recording(log), mask)
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    updates, _ = run(tx, value=2.0, tags=GRADS)
    torch.testing.assert_close(updates["w"], GRADS["w"] * 2.0)
    torch.testing.assert_close(updates["b"], GRADS["b"])  # masked out: untouched
    assert log[-1][2]["tags"] is GRADS  # passed as given by default
    tx = gtx.masked(recording(log), mask, mask_compatible_extra_args=True)
    run(tx, value=2.0, tags=GRADS, other=1)
    seen = log[-1][2]
    assert seen["tags"]["b"] is None and seen["tags"]["w"] is GRADS["w"] and seen["other"] == 1
    # a plain inner never receives them
    assert not isinstance(gtx.masked(strict_plain(log), mask), gtx.GradientTransformationExtraArgs)
    updates, _ = run(gtx.masked(strict_plain(log), mask), value=2.0)
    torch.testing.assert_close(updates, GRADS)


def test_partition_forwards_to_the_groups_that_take_them():
    log: list = []
    tx = gtx.partition({"a": recording(log, "a"), "b": strict_plain(log)}, {"w": "a", "b": "b"})
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    updates, _ = run(tx, value=4.0)
    torch.testing.assert_close(updates["w"], GRADS["w"] * 4.0)
    torch.testing.assert_close(updates["b"], GRADS["b"])
    assert [entry[0] for entry in log] == ["a", "strict"]
    assert not isinstance(gtx.partition({"a": gtx.scale(1.0)}, {"w": "a", "b": "a"}), gtx.GradientTransformationExtraArgs)


def test_apply_if_finite_forwards():
    log: list = []
    tx = gtx.apply_if_finite(recording(log), max_consecutive_errors=2)
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    updates, state = run(tx, value=0.5)
    torch.testing.assert_close(updates["w"], GRADS["w"] * 0.5)
    assert float(log[-1][1]) == 0.5
    updates, _ = run(gtx.apply_if_finite(strict_plain(log), 2), value=0.5)
    torch.testing.assert_close(updates, GRADS)


@pytest.mark.parametrize("on_device", [False, True])
def test_multisteps_forwards_on_emitting_steps(on_device):
    log: list = []
    skip = gtx.skip_not_finite if on_device else None
    ms = gtx.MultiSteps(recording(log), every_k_schedule=2, should_skip_update_fn=skip)
    tx = ms.gradient_transformation()
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    state = tx.init(PARAMS)
    zeros, state = tx.update(GRADS, state, PARAMS, value=10.0)
    torch.testing.assert_close(zeros["w"], torch.zeros(3))
    updates, state = tx.update(GRADS, state, PARAMS, value=3.0)
    torch.testing.assert_close(updates["w"], GRADS["w"] * 3.0)
    assert float(log[-1][1]) == 3.0
    plain_ms = gtx.MultiSteps(strict_plain(log), every_k_schedule=1).gradient_transformation()
    assert not isinstance(plain_ms, gtx.GradientTransformationExtraArgs)
    updates, _ = plain_ms.update(GRADS, plain_ms.init(PARAMS), PARAMS, value=1.0)
    torch.testing.assert_close(updates, GRADS)


def test_inject_hyperparams_forwards():
    log: list = []

    def factory(gain: float = 1.0):
        inner = recording(log)

        def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
            updates, state = inner.update(updates, state, params, inplace=inplace, **extra_args)
            return {k: u * gain for k, u in updates.items()}, state

        return gtx.GradientTransformationExtraArgs(inner.init, update_fn)

    tx = gtx.inject_hyperparams(factory)(gain=lambda count: 2.0)
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    updates, state = run(tx, value=3.0)
    torch.testing.assert_close(updates["w"], GRADS["w"] * 6.0)
    plain_tx = gtx.inject_hyperparams(gtx.scale)(step_size=2.0)
    assert not isinstance(plain_tx, gtx.GradientTransformationExtraArgs)
    updates, _ = run(plain_tx, value=3.0)
    torch.testing.assert_close(updates["w"], GRADS["w"] * 2.0)


def test_monitor_forwards_to_measures_that_take_them():
    def value_measure():
        def update_fn(updates, state, params=None, *, inplace=False, value=None, **extra_args):
            return torch.as_tensor(-1.0 if value is None else value), state

        return gtx.GradientTransformationExtraArgs(gtx.init_empty_state, update_fn)

    tx = gtx.monitor({"loss": value_measure(), "norm": lambda u: gtx.global_norm(u)})
    assert isinstance(tx, gtx.GradientTransformationExtraArgs)
    state = tx.init(PARAMS)
    assert float(gtx.get_measurement(state, "loss")) == -1.0
    updates, state = tx.update(GRADS, state, PARAMS, value=7.0)
    assert float(gtx.get_measurement(state, "loss")) == 7.0
    torch.testing.assert_close(updates, GRADS)
    assert not isinstance(gtx.monitor({"norm": gtx.global_norm}), gtx.GradientTransformationExtraArgs)


def test_alias_in_a_chain_with_an_extra_args_member():
    log: list = []
    assert not isinstance(gtx.sgd(0.1), gtx.GradientTransformationExtraArgs)
    tx = gtx.chain(gtx.sgd(0.1), recording(log))
    updates, _ = run(tx, value=2.0)
    torch.testing.assert_close(updates["w"], GRADS["w"] * -0.2)


def test_inplace_is_forwarded_with_extra_args():
    seen = []

    def update_fn(updates, state, params=None, *, inplace=False, **extra_args):
        seen.append((inplace, extra_args))
        return updates, state

    tx = gtx.chain(gtx.scale(1.0), gtx.GradientTransformationExtraArgs(gtx.init_empty_state, update_fn))
    grads = {k: v.clone() for k, v in GRADS.items()}
    tx.update(grads, tx.init(PARAMS), PARAMS, inplace=True, value=1.0)
    assert seen == [(True, {"value": 1.0})]


def test_missing_required_extra_arg_is_a_type_error():
    def update_fn(updates, state, params=None, *, value, **extra_args):
        return updates, state

    tx = gtx.chain(gtx.scale(1.0), gtx.GradientTransformationExtraArgs(gtx.init_empty_state, update_fn))
    with pytest.raises(TypeError):
        run(tx)
