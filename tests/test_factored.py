"""``adafactor`` (optax's definition) against ``torch.optim.Adafactor``: where the two definitions
agree the trajectories match to float64 rounding; where they differ, the difference is the one
documented, and it shows.

The definitions agree when gradtx is given torch's relative step ``min(lr, 1 / sqrt(t))`` as its
learning rate schedule, ``weight_decay_rate = lr * weight_decay``, and ``min_dim_size_to_factor``
small enough that every matrix is factored. They differ in:

1. which dims are factored: torch factors the last two dims of every tensor of two or more dims,
   optax the two largest, and only when both have ``min_dim_size_to_factor`` entries (default 128);
2. the floor of the second moment: torch clamps its estimate at ``eps1^2`` (``eps1`` defaults to
   the dtype's machine epsilon), optax adds ``eps`` (1e-30) to ``g^2`` before averaging;
3. the step size: torch's is always ``min(lr, 1 / sqrt(t))`` times the parameter RMS, optax's is
   ``learning_rate`` (a number or any schedule) times it;
4. weight decay: torch multiplies the parameter by ``1 - lr * weight_decay`` with its constant
   ``lr`` (not the relative step), optax adds ``weight_decay_rate * param`` (give ``lr * wd``);
5. optax may add momentum (``momentum=``), torch has none; torch has ``maximize``, optax does not.

The row/column normalisation agrees whatever dim is called a row: with ``r``, ``c`` the means of
``g^2`` along each factored dim, ``mean(r) == mean(c)``, so ``r c / mean(r)`` is symmetric.
"""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from optimizer_helpers import assert_trees_close, grad_sequence, gradtx_trajectory, torch_trajectory, tree

STEPS = 5
LR = 0.05


def _relative_step(lr):
    return lambda count: torch.clamp((count.to(torch.float64) + 1.0) ** -0.5, max=lr)


def _both(shapes, *, weight_decay=0.0, grad_scale=1.0, torch_eps=(None, 1e-3), **kwargs):
    params = tree(0, shapes=shapes)
    grads = [{k: v * grad_scale for k, v in g.items()} for g in grad_sequence(STEPS, shapes=shapes)]
    options = dict(min_dim_size_to_factor=1, weight_decay_rate=LR * weight_decay if weight_decay else None)
    options.update(kwargs)
    ours, _ = gradtx_trajectory(gtx.adafactor(options.pop("learning_rate", _relative_step(LR)), **options), params, grads)
    theirs = torch_trajectory(
        lambda ps: torch.optim.Adafactor(ps, lr=LR, weight_decay=weight_decay, eps=torch_eps, foreach=False), params, grads
    )
    return params, ours, theirs


@pytest.mark.parametrize("weight_decay", [0.0, 0.2])
def test_agrees_where_the_definitions_agree(weight_decay):
    shapes = {
        "tall": (7, 3),
        "wide": (3, 7),
        "batched": (2, 5, 6),  # the last two dims are the two largest: both factor (5, 6)
        "square": (4, 4),
        "bias": (5,),
        "scalar": (),
    }
    _, ours, theirs = _both(shapes, weight_decay=weight_decay)
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_agrees_on_small_parameters():
    """Both floor the parameter RMS at 1e-3 (torch's eps2, optax's scale_by_param_block_rms)."""
    shapes = {"w": (4, 6), "b": (6,)}
    params = {k: 1e-5 * v for k, v in tree(0, shapes=shapes).items()}
    grads = grad_sequence(STEPS, shapes=shapes)
    ours, _ = gradtx_trajectory(gtx.adafactor(_relative_step(LR), min_dim_size_to_factor=1), params, grads)
    theirs = torch_trajectory(lambda ps: torch.optim.Adafactor(ps, lr=LR, foreach=False), params, grads)
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-14)


def test_differs_in_which_dims_are_factored():
    """(1) A (6, 2, 3) tensor: torch factors dims (1, 2), optax the two largest, (0, 2)."""
    shapes = {"odd": (6, 2, 3), "bias": (3,)}
    _, ours, theirs = _both(shapes)
    assert not torch.allclose(ours["odd"], theirs["odd"], rtol=1e-6)
    torch.testing.assert_close(ours["bias"], theirs["bias"], rtol=1e-10, atol=1e-12)
    # factoring the same dims (a tensor whose last two dims are its largest) they agree again
    _, ours, theirs = _both({"even": (2, 3, 6)})
    torch.testing.assert_close(ours["even"], theirs["even"], rtol=1e-10, atol=1e-12)


def test_differs_in_the_floor_of_the_second_moment():
    """(2) Gradients of size 1e-4 against torch's eps1 = 1e-3: torch clamps the estimate at 1e-6 and
    shrinks the update ~10x, optax's additive 1e-30 does not."""
    shapes = {"w": (4, 6), "b": (6,)}
    params, ours, theirs = _both(shapes, grad_scale=1e-4, torch_eps=(1e-3, 1e-3))
    for name in shapes:
        ours_step = (ours[name] - params[name]).abs().mean()
        theirs_step = (theirs[name] - params[name]).abs().mean()
        assert theirs_step < 0.3 * ours_step, (name, float(ours_step), float(theirs_step))
    # with torch's default eps1 (machine epsilon) the floor is out of the way
    _, ours, theirs = _both(shapes, grad_scale=1e-4)
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_differs_in_the_step_size():
    """(3) A constant learning rate is not torch's relative step (torch's is 1 / sqrt(t) once that
    is below lr; at lr = 0.5 that is from the fifth step on)."""
    shapes = {"w": (4, 6)}
    params = tree(0, shapes=shapes)
    grads = grad_sequence(STEPS, shapes=shapes)
    ours, _ = gradtx_trajectory(gtx.adafactor(0.5, min_dim_size_to_factor=1), params, grads)
    theirs = torch_trajectory(lambda ps: torch.optim.Adafactor(ps, lr=0.5, foreach=False), params, grads)
    assert not torch.allclose(ours["w"], theirs["w"], rtol=1e-6)
    ours, _ = gradtx_trajectory(gtx.adafactor(0.5, min_dim_size_to_factor=1), params, grads[:4])
    theirs = torch_trajectory(lambda ps: torch.optim.Adafactor(ps, lr=0.5, foreach=False), params, grads[:4])
    # 1 / sqrt(t) > 0.5 for t < 4, equal at t = 4: the first four steps agree
    torch.testing.assert_close(ours["w"], theirs["w"], rtol=1e-10, atol=1e-12)


def test_differs_in_weight_decay_under_a_schedule():
    """(4) torch decays by its constant lr, not by the relative step: optax's weight_decay_rate is a
    separate rate, so equal only when given as lr * weight_decay."""
    shapes = {"w": (4, 6)}
    _, ours, theirs = _both(shapes, weight_decay=0.2)
    torch.testing.assert_close(ours["w"], theirs["w"], rtol=1e-10, atol=1e-12)
    _, ours, theirs = _both(shapes, weight_decay=0.2, weight_decay_rate=0.2)  # the rate without lr
    assert not torch.allclose(ours["w"], theirs["w"], rtol=1e-6)


def test_differs_with_momentum():
    """(5) optax's optional momentum has no torch counterpart."""
    shapes = {"w": (4, 6)}
    _, ours, theirs = _both(shapes, momentum=0.9)
    assert not torch.allclose(ours["w"], theirs["w"], rtol=1e-6)
