"""Adadelta (Zeiler, 2012) and Yogi (Zaheer et al., 2018): adaptive second-moment scalings."""

from __future__ import annotations

from typing import Any, NamedTuple

from gradtx import tree as tree_lib
from gradtx.base import GradientTransformation
from gradtx.sharding import dtensor as dtensor_lib
from gradtx.state_signs import nonnegative
from gradtx.transforms import _foreach as fe
from gradtx.transforms.adam import ScaleByAdamState, _check_decay, _correction, first_moment, second_moment


@nonnegative("e_g", "e_x")
class ScaleByAdaDeltaState(NamedTuple):
    """``e_g``: moving average of squared gradients; ``e_x``: of squared updates, like the params."""

    e_g: Any
    e_x: Any


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Adadelta: ``e_g = rho * e_g + (1 - rho) * g^2``, ``u = sqrt(e_x + eps) / sqrt(e_g + eps) * g``,
    then ``e_x = rho * e_x + (1 - rho) * u^2``; the same numbers as ``torch.optim.Adadelta`` with ``lr=1``."""
    owner = "scale_by_adadelta"
    rho, eps = _check_decay("rho", rho, owner), float(eps)

    def init_fn(params: Any) -> ScaleByAdaDeltaState:
        # optax squares a complex g as g * g here, and lists Adadelta among its real-only optimizers
        tree_lib.refuse_complex(params, owner=owner, why="Adadelta's moments are defined for real numbers")
        return ScaleByAdaDeltaState(e_g=fe.zeros_like_tree(params), e_x=fe.zeros_like_tree(params))

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        e_g = leaves.aligned(state.e_g, what=f"{owner}: state.e_g")
        e_x = leaves.aligned(state.e_x, what=f"{owner}: state.e_x")

        def group(g, eg, ex):
            eg = second_moment(eg, fe.cast(g, eg[0].dtype), rho, inplace=inplace)
            numer = fe.sqrt(fe.add(ex, eps, inplace=False), inplace=True)
            denom = fe.sqrt(fe.add(eg, eps, inplace=False), inplace=True)
            u = fe.mul(fe.div(numer, denom, inplace=True), fe.cast(g, numer[0].dtype), inplace=True)
            ex = second_moment(ex, u, rho, inplace=inplace)
            u = fe.finish(u, g)
            return (fe.copy_into(g, u) if inplace else u), eg, ex

        new_updates, new_eg, new_ex = fe.map_groups(group, leaves.tensors, e_g, e_x, outputs=3, pack=not inplace)
        return leaves.rebuild(new_updates), ScaleByAdaDeltaState(
            e_g=leaves.rebuild(new_eg, like=state.e_g), e_x=leaves.rebuild(new_ex, like=state.e_x)
        )

    return GradientTransformation(init_fn, update_fn)


def scale_by_yogi(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-3,
    eps_root: float = 0.0,
    initial_accumulator_value: float = 1e-6,
) -> GradientTransformation:
    """Yogi: Adam whose second moment moves additively, ``nu -= (1 - b2) * sign(nu - g^2) * g^2``
    (``g^2`` is ``|g|^2`` for complex ``g``, as in optax).

    Both moments start at ``initial_accumulator_value``; the update is
    ``mu_hat / (sqrt(nu_hat + eps_root) + eps)`` with the usual bias corrections, and the state is a
    :class:`ScaleByAdamState`, as in optax.
    """
    owner = "scale_by_yogi"
    b1, b2 = _check_decay("b1", b1, owner), _check_decay("b2", b2, owner)
    eps, eps_root, initial = float(eps), float(eps_root), float(initial_accumulator_value)

    def init_fn(params: Any) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=fe.zero_count(params), mu=fe.full_like_tree(params, initial), nu=fe.full_like_tree(params, initial)
        )

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        leaves = fe.leaves_of(updates, what=owner)
        mu = leaves.aligned(state.mu, what=f"{owner}: state.mu")
        nu = leaves.aligned(state.nu, what=f"{owner}: state.nu")
        count = fe.increment(state.count, inplace=inplace)
        inv_bc1, inv_bc2 = 1.0 / _correction(b1, count), 1.0 / _correction(b2, count)

        def group(g, m, v):
            m = first_moment(m, g, b1, inplace=inplace)
            g_sq = fe.squares(fe.cast(g, v[0].dtype))
            direction = fe.sign(fe.add(v, g_sq, alpha=-1.0, inplace=False), inplace=True)
            v = fe.add(v, fe.mul(direction, g_sq, inplace=True), alpha=-(1.0 - b2), inplace=inplace)
            d = fe.mul(v, fe.on(inv_bc2, v), inplace=False)
            if not fe.known_zero(eps_root):
                d = fe.add(d, eps_root, inplace=True)
            # a new tensor for the sum: autograd needs the square root as it was
            d = fe.add(fe.sqrt(d, inplace=True), eps, inplace=False)
            out = fe.div(fe.mul(fe.cast(m, d[0].dtype), fe.on(inv_bc1, d), inplace=False), d, inplace=True)
            out = fe.finish(out, g)
            return (fe.copy_into(g, out) if inplace else out), m, v

        grads = dtensor_lib.without_partial(leaves.tensors)  # its in-place sign cannot take a Partial gradient
        new_updates, new_mu, new_nu = fe.map_groups(group, grads, mu, nu, outputs=3, pack=not inplace)
        return leaves.rebuild(new_updates), ScaleByAdamState(
            count=count, mu=leaves.rebuild(new_mu, like=state.mu), nu=leaves.rebuild(new_nu, like=state.nu)
        )

    return GradientTransformation(init_fn, update_fn)
