"""from_torch: any torch optimizer as a pure transformation, checked against the optimizer itself.

The reference is always the optimizer used the ordinary way (``p.grad = g; opt.step()``): the
transformation's update must be exactly ``new_param - param`` and its state exactly the
optimizer's per-parameter state, step after step.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx.interop.from_torch import FromTorchState, from_torch

SHAPES = {"w": (6, 5), "b": (5,), "frozen": None, "v": (3,)}
STEPS = 6


def make_params(seed: int = 0, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: None if s is None else torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}


def make_grads(step: int, dtype=torch.float32, late_start: bool = True) -> dict:
    """Gradients for step ``step``; ``b`` has none on step 0 (its state starts one step late)."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = {k: None if s is None else torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
    if step == 0 and late_start:
        grads["b"] = None
    return grads


def torch_trajectory(cls, hyperparams, params):
    """Runs ``cls`` the ordinary way; yields (grads, params before, params after, optimizer) per step."""
    names = [k for k, v in params.items() if v is not None]
    live = {k: params[k].clone().requires_grad_() for k in names}
    opt = cls([live[k] for k in names], **hyperparams)
    # torch's fused SGD fails when some momentum buffers exist and others not yet: no late start there.
    late_start = not (cls is torch.optim.SGD and hyperparams.get("fused"))
    for step in range(STEPS):
        grads = make_grads(step, params[names[0]].dtype, late_start)
        for k in names:
            live[k].grad = None if grads[k] is None else grads[k].clone()
        before = {k: live[k].detach().clone() for k in names}
        opt.step()
        yield grads, before, {k: live[k].detach().clone() for k in names}, opt, live


def assert_slots_equal(slots, opt, live, names):
    for k in names:
        expected = opt.state[live[k]]
        actual = slots[k]
        assert set(actual) == set(expected), (k, set(actual), set(expected))
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert actual[key].dtype == value.dtype and actual[key].device == value.device, (k, key)
                assert torch.equal(actual[key], value), (k, key)
            else:
                assert actual[key].item() == value, (k, key)


CASES = [
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-2, fused=True, betas=(0.8, 0.9))),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),  # general engine (lazy buffer)
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True)),
    (torch.optim.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5, weight_decay=0.01)),
    (torch.optim.RMSprop, dict(lr=1e-2, foreach=True)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, fused=True)),
    (torch.optim.Adamax, dict(lr=0.1)),
    (torch.optim.NAdam, dict(lr=0.1, decoupled_weight_decay=True, weight_decay=0.1)),
    (torch.optim.RAdam, dict(lr=0.1)),
    (torch.optim.Adadelta, dict(lr=1.0)),
    (torch.optim.Rprop, dict(lr=0.1)),
    (torch.optim.ASGD, dict(lr=0.1, t0=2)),
]


def case_id(case):
    cls, hp = case
    return cls.__name__ + "-" + ",".join(f"{k}={v}" for k, v in hp.items())


@pytest.mark.parametrize("cls,hyperparams", CASES, ids=[case_id(c) for c in CASES])
def test_update_is_the_optimizers_step_and_state_is_its_state(cls, hyperparams):
    params = make_params()
    names = [k for k, v in params.items() if v is not None]
    tx = from_torch(cls, **hyperparams)
    state = tx.init(params)
    for grads, before, after, opt, live in torch_trajectory(cls, hyperparams, params):
        current = dict(params, **before)
        updates, state = tx.update(grads, state, current)
        assert updates["frozen"] is None
        for k in names:
            if grads[k] is None:
                assert updates[k] is None
            else:
                assert torch.equal(updates[k], after[k] - before[k]), k
    assert_slots_equal(state.slots, opt, live, names)
    assert all(bool(state.initialized[k]) for k in names)


@pytest.mark.parametrize("cls,hyperparams", [CASES[0], CASES[8], CASES[13], CASES[16]], ids=lambda c: None)
def test_apply_updates_follows_the_optimizers_trajectory(cls, hyperparams):
    params = make_params()
    tx = from_torch(cls, **hyperparams)
    state = tx.init(params)
    for grads, _, after, _, _ in torch_trajectory(cls, hyperparams, params):
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        for k, value in after.items():
            torch.testing.assert_close(params[k], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls,hyperparams", [CASES[1], CASES[5], CASES[8], CASES[15]], ids=lambda c: None)
def test_pure_update_mutates_nothing_and_inplace_gives_the_same_numbers(cls, hyperparams):
    params = make_params()
    tx = from_torch(cls, **hyperparams)
    pure_state, donated_state = tx.init(params), tx.init(params)
    for step in range(3):
        grads = make_grads(step)
        snapshot = [x.clone() for x in gtx.tree.leaves((grads, pure_state, params)) if x is not None]
        pure_updates, pure_state_next = tx.update(grads, pure_state, params)
        after = [x for x in gtx.tree.leaves((grads, pure_state, params)) if x is not None]
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after)), "pure update mutated its inputs"
        donated_grads = gtx.tree.tree_map(torch.clone, grads)
        donated_updates, donated_state = tx.update(donated_grads, donated_state, params, inplace=True)
        for a, b in zip(gtx.tree.leaves((pure_updates, pure_state_next)), gtx.tree.leaves((donated_updates, donated_state))):
            assert (a is None and b is None) or torch.equal(a, b)
        pure_state = pure_state_next


def test_torch_builtin_runs_kernels_without_building_optimizers(monkeypatch):
    built, stepped = [], []
    original_init, original_step = torch.optim.AdamW.__init__, torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "__init__", lambda self, *a, **k: built.append(1) or original_init(self, *a, **k))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: stepped.append(1) or original_step(self, *a, **k))
    tx = from_torch(torch.optim.AdamW, lr=1e-3, fused=True)
    params = make_params()
    state = tx.init(params)
    for step in range(3):
        _, state = tx.update(make_grads(step), state, params)
    assert len(built) == 1 and not stepped  # built once to check the hyperparameters; never stepped


class SignMomentum(torch.optim.Optimizer):
    """A third-party style optimizer: python-number step count, tensor buffer, decoupled decay."""

    def __init__(self, params, lr=1e-2, beta=0.9, weight_decay=0.0):
        if lr <= 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["buf"] = p.grad.clone()  # first step: the gradient itself
                else:
                    state["buf"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                state["step"] += 1
                scale = group["lr"] * math.sqrt(state["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(state["buf"].sign(), alpha=-scale)


class ScaledAdam(torch.optim.Adam):
    """A subclass of a torch optimizer: runs its own step (the general engine), not Adam's kernel."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)  # mutates the gradient: the pure path must not let that leak
        return super().step(closure)


@pytest.mark.parametrize(
    "cls,hyperparams", [(SignMomentum, dict(lr=0.05, weight_decay=0.1)), (ScaledAdam, dict(lr=1e-2))], ids=["custom", "subclass"]
)
def test_custom_optimizers_match_their_ordinary_use(cls, hyperparams):
    params = make_params()
    names = [k for k, v in params.items() if v is not None]
    tx = from_torch(cls, **hyperparams)
    state = tx.init(params)
    for grads, before, after, opt, live in torch_trajectory(cls, hyperparams, params):
        grads_copy = gtx.tree.tree_map(torch.clone, grads)
        updates, state = tx.update(grads, state, dict(params, **before))
        assert all(torch.equal(a, b) for a, b in zip(gtx.tree.leaves(grads_copy), gtx.tree.leaves(grads)) if a is not None)
        for k in names:
            if grads[k] is not None:
                assert torch.equal(updates[k], after[k] - before[k]), k
    assert_slots_equal(state.slots, opt, live, names)
    if cls is SignMomentum:
        assert state.slots["w"]["step"].dtype == torch.int64 and int(state.slots["w"]["step"]) == STEPS


def test_state_is_a_pytree_of_tensors_that_saves_and_loads_with_weights_only():
    params = make_params()
    for cls, hp in [(torch.optim.AdamW, dict(lr=1e-2)), (SignMomentum, dict(lr=0.05))]:
        tx = from_torch(cls, **hp)
        state = tx.init(params)
        for step in range(2):
            _, state = tx.update(make_grads(step), state, params)
        assert isinstance(state, FromTorchState)
        assert all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in gtx.tree.leaves(state))
        buffer = io.BytesIO()
        torch.save({"slots": state.slots, "initialized": state.initialized}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        restored = FromTorchState(loaded["slots"], loaded["initialized"])
        a, _ = tx.update(make_grads(5), state, params)
        b, _ = tx.update(make_grads(5), restored, params)
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(gtx.tree.leaves(a), gtx.tree.leaves(b)))


def test_in_a_chain_after_clipping_it_matches_clip_grad_norm_then_step():
    params = make_params()
    names = [k for k, v in params.items() if v is not None]
    tx = gtx.chain(gtx.clip_by_global_norm(0.5), from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
    state = tx.init(params)
    live = {k: params[k].clone().requires_grad_() for k in names}
    opt = torch.optim.AdamW([live[k] for k in names], lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        grads = make_grads(step)
        for k in names:
            live[k].grad = None if grads[k] is None else grads[k].clone()
        before = {k: live[k].detach().clone() for k in names}
        torch.nn.utils.clip_grad_norm_([live[k] for k in names], 0.5)
        opt.step()
        updates, state = tx.update(grads, state, dict(params, **before))
        for k in names:
            if grads[k] is not None:
                assert torch.equal(updates[k], live[k].detach() - before[k]), k


@settings(max_examples=12, deadline=None)
@given(
    lr=st.floats(1e-4, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    weight_decay=st.floats(0.0, 0.5),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    kernel=st.sampled_from(["single", "foreach", "fused"]),
)
def test_adam_matches_torch_for_any_hyperparameters(lr, beta1, beta2, weight_decay, amsgrad, maximize, kernel):
    hp = dict(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    hp.update({"foreach": True} if kernel == "foreach" else {"fused": True} if kernel == "fused" else {"foreach": False})
    params = make_params(seed=3)
    names = [k for k, v in params.items() if v is not None]
    tx = from_torch(torch.optim.Adam, **hp)
    state = tx.init(params)
    for grads, before, after, _, _ in torch_trajectory(torch.optim.Adam, hp, params):
        updates, state = tx.update(grads, state, dict(params, **before))
        for k in names:
            if grads[k] is not None:
                assert torch.equal(updates[k], after[k] - before[k])


# --------------------------------------------------------------------------- bad input


def test_rejects_what_is_not_an_optimizer_class():
    with pytest.raises(TypeError, match="Optimizer subclass"):
        from_torch(torch.nn.Linear, lr=0.1)
    with pytest.raises(TypeError, match="an instance of SGD"):
        from_torch(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))


def test_hyperparameters_the_optimizer_rejects_raise_when_built():
    with pytest.raises(ValueError, match=r"from_torch\(Adam\).*Invalid learning rate"):
        from_torch(torch.optim.Adam, lr=-1.0)
    with pytest.raises(ValueError, match=r"from_torch\(SignMomentum\).*Invalid learning rate"):
        from_torch(SignMomentum, lr=0.0)
    with pytest.raises(TypeError, match=r"from_torch\(SGD\).*momentom"):
        from_torch(torch.optim.SGD, lr=0.1, momentom=0.9)


def test_update_checks_params_and_gradients():
    params = make_params()
    tx = from_torch(torch.optim.SGD, lr=0.1)
    state = tx.init(params)
    with pytest.raises(ValueError, match="params are required"):
        tx.update(make_grads(1), state)
    bad = make_grads(1)
    bad["v"] = bad["v"].double()
    with pytest.raises(ValueError, match="leaf 'v'.*float64"):
        tx.update(bad, state, params)
    with pytest.raises(ValueError, match=r"from_torch\(SGD\): gradients do not match params: params has leaf 'v' that gradients lacks"):
        tx.update({k: g for k, g in make_grads(1).items() if k != "v"}, state, params)


def test_optimizers_that_need_a_closure_fail_clearly_at_init():
    tx = from_torch(torch.optim.LBFGS, lr=0.1)
    with pytest.raises(RuntimeError, match=r"from_torch\(LBFGS\): a trial step .*failed"):
        tx.init(make_params())


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without Muon")
def test_an_optimizer_for_matrices_only():
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(5, 4, generator=gen), "b": torch.randn(3, 6, generator=gen)}
    tx = from_torch(torch.optim.Muon, lr=0.05, weight_decay=0.1)
    state = tx.init(params)
    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.Muon(list(live.values()), lr=0.05, weight_decay=0.1)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        for k in live:
            live[k].grad = grads[k].clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        for k in params:
            assert torch.equal(updates[k], live[k].detach() - params[k])
            params[k] = live[k].detach().clone()
