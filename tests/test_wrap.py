"""wrap / ChainedOptimizer: a drop-in torch optimizer, checked against torch's own training loop.

Every test runs the same loop twice, once the ordinary torch way (``clip_grad_norm_`` and the bare
optimizer) and once through ``gradtx.wrap``, and compares parameters bit for bit.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import gradtx as gtx
from gradtx.interop.wrap import STATE_KEY, ChainedOptimizer


def small_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, image: bool = False, scale: float = 1.0):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn((8, 3, 12, 12) if image else (8, 6), generator=gen) * scale
    y = torch.randint(0, 10 if image else 3, (8,), generator=gen)
    return x, y


def loss_of(model: nn.Module, step: int, image: bool = False, scale: float = 1.0) -> torch.Tensor:
    x, y = batch(step, image, scale)
    return nn.functional.cross_entropy(model(x), y)


def same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


class EmaState(NamedTuple):
    ema: Any
    count: torch.Tensor


def ema_of_grads(decay: float) -> gtx.GradientTransformation:
    """A stateful gradient transformation (momentum on gradients) defined here as an independent check."""

    def init_fn(params):
        return EmaState(gtx.tree.tree_map(torch.zeros_like, params), torch.zeros((), dtype=torch.int64))

    def update_fn(updates, state, params=None, *, inplace=False):
        ema = gtx.tree.tree_map(lambda g, m: m * decay + g * (1 - decay), updates, state.ema)
        return gtx.tree.tree_map(torch.clone, ema), EmaState(ema, state.count + 1)

    return gtx.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- the Colossal-AI loop


def test_seed_loop_clip_grad_by_norm_between_backward_and_step():
    """Colossal-AI's gradient-clipping example: SGD + CosineAnnealingLR, clip to 0.1, 4 iterations."""
    model, reference = small_cnn(), small_cnn()
    optimizer = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4), model=model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    ref_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(ref_optimizer, T_max=200)
    start = [p.detach().clone() for p in model.parameters()]
    for idx in range(4):
        model.zero_grad()
        loss_of(model, idx, image=True).backward()
        before = torch.nn.utils.get_total_norm(grads_of(model))
        norm = optimizer.clip_grad_by_norm(max_norm=0.1)
        assert torch.equal(norm, before)  # the norm before clipping, like clip_grad_norm_
        assert float(torch.nn.utils.get_total_norm(grads_of(model))) <= 0.1 + 1e-6
        lr = optimizer.param_groups[0]["lr"]
        assert lr == pytest.approx(0.1 * (1 + math.cos(math.pi * idx / 200)) / 2, rel=1e-12)
        optimizer.step()
        scheduler.step()

        reference.zero_grad()
        loss_of(reference, idx, image=True).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
        ref_optimizer.step()
        ref_scheduler.step()
        assert torch.equal(norm, ref_norm)
        assert same_params(model, reference)  # same lr schedule applied, same numbers
    assert optimizer.param_groups[0]["lr"] == ref_scheduler.get_last_lr()[0]
    assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters()))


# --------------------------------------------------------------------------- equal to clip_grad_norm_ + step

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "Adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "SGD-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "Adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


def run_torch(make, max_norm, steps=12, scale=1.0):
    model = mlp()
    opt = make(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step, scale=scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return model


def run_wrapped(make, max_norm, steps=12, scale=1.0, fold=True):
    model = mlp()
    opt = gtx.wrap(make(model.parameters()), gtx.clip_by_global_norm(max_norm), model=model, fold=fold)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step, scale=scale).backward()
        expected_norm = torch.nn.utils.get_total_norm(grads_of(model))
        opt.step()
        norms.append((opt.tx_state.norm, expected_norm))
    assert all(torch.equal(a, b) for a, b in norms)  # the pre-clip norm is logged in the state
    return model


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_wrapped_clip_equals_clip_grad_norm_then_step(name):
    # fold=False keeps the separate scaling pass: bit-identical to torch for every optimizer.
    assert same_params(run_wrapped(OPTIMIZERS[name], 0.3, fold=False), run_torch(OPTIMIZERS[name], 0.3))


@pytest.mark.parametrize("name", ["SGD-fused", "AdamW-fused", "Adagrad-fused"])
def test_folding_into_fused_kernels(name):
    make = OPTIMIZERS[name]
    # The clip never engages: the folded scale is exactly 1 and the result is torch's, bit for bit.
    assert same_params(run_wrapped(make, 1e9), run_torch(make, 1e9))
    # It engages on every step: the kernel computes g / (1 / c) instead of g * c, one rounding apart.
    folded, unfolded = run_wrapped(make, 0.05), run_wrapped(make, 0.05, fold=False)
    assert same_params(unfolded, run_torch(make, 0.05))
    for p, q in zip(folded.parameters(), unfolded.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # And the folded result is exactly "divide by the reciprocal of the coefficient, then step".
    model = mlp()
    opt = make(model.parameters())
    for step in range(12):
        opt.zero_grad()
        loss_of(model, step).backward()
        grads = grads_of(model)
        coef = torch.clamp(0.05 / (torch.nn.utils.get_total_norm(grads) + 1e-6), max=1.0)
        torch._foreach_div_(grads, torch.reciprocal(coef))
        opt.step()
    assert same_params(folded, model)


def test_fold_leaves_clipped_gradients_in_grad_and_runs_head_transforms():
    model, reference = mlp(), mlp()
    tx = gtx.chain(gtx.clip_by_value(0.05), gtx.clip_by_global_norm(0.1))
    opt = gtx.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), tx, model=model)
    ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(5):
        for m in (model, reference):
            m.zero_grad()
            loss_of(m, step).backward()
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        opt.step()
        ref.step()
        for g, h in zip(grads_of(model), grads_of(reference)):
            torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-9)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not hasattr(opt.optimizer, "grad_scale")


def test_clip_grad_by_value_and_inf_norm_match_torch():
    model, reference = mlp(), mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1))
    for m in (model, reference):
        loss_of(m, 0, scale=10.0).backward()
    opt.clip_grad_by_value(clip_value=0.01)
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
    assert all(torch.equal(g, h) for g, h in zip(grads_of(model), grads_of(reference)))
    norm = opt.clip_grad_by_norm(0.005, norm_type=math.inf)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.005, norm_type=math.inf))
    assert all(torch.equal(g, h) for g, h in zip(grads_of(model), grads_of(reference)))
    next(model.parameters()).grad[0, 0] = math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_by_norm(1.0, error_if_nonfinite=True)


def test_params_without_gradients_are_skipped():
    model = mlp()
    model[2].bias.requires_grad_(False)
    opt = gtx.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), gtx.clip_by_global_norm(0.1), model=model)
    frozen = model[2].bias.detach().clone()
    loss_of(model, 0).backward()
    opt.step()
    assert torch.equal(model[2].bias, frozen) and model[2].bias not in opt.state
    assert float(torch.nn.utils.get_total_norm(grads_of(model))) <= 0.1 + 1e-6


# --------------------------------------------------------------------------- names


def test_gradients_are_named_by_the_model_or_by_position():
    seen = []

    def record(updates, params):
        seen.append(sorted(updates))
        return updates

    model = mlp()
    gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.stateless(record), model=model).step()
    gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.stateless(record)).step()
    gtx.wrap(torch.optim.SGD(model.named_parameters(), lr=0.1), gtx.stateless(record)).step()
    assert seen[0] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert seen[1] == ["group0.param0", "group0.param1", "group0.param2", "group0.param3"]
    assert seen[2] == seen[0]


def test_names_let_masks_pick_leaves():
    model, reference = mlp(), mlp()
    no_bias = gtx.masked(gtx.clip_by_value(0.0), lambda tree: {k: k.endswith("weight") for k in tree})
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), no_bias, model=model)
    ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for m in (model, reference):
        loss_of(m, 0).backward()
    for name, p in reference.named_parameters():
        if name.endswith("weight"):
            p.grad.zero_()
    opt.step()
    ref.step()
    assert same_params(model, reference)


def test_a_mask_dict_in_any_key_order_matches_by_name():
    # the chain sees the gradients in parameter order; a plain-dict mask written in another order
    # (here reversed) still selects by name
    model, reference = mlp(), mlp()
    names = [name for name, _ in model.named_parameters()]
    mask = {name: name.endswith("weight") for name in reversed(names)}
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.masked(gtx.clip_by_value(0.0), mask), model=model)
    ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for m in (model, reference):
        loss_of(m, 0).backward()
    for name, p in reference.named_parameters():
        if name.endswith("weight"):
            p.grad.zero_()
    opt.step()
    ref.step()
    assert same_params(model, reference)


# --------------------------------------------------------------------------- the Optimizer API


def test_is_a_torch_optimizer_sharing_groups_state_and_defaults():
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = gtx.wrap(inner, gtx.clip_by_global_norm(1.0))
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, ChainedOptimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loss_of(model, 0).backward()
    opt.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 5e-3  # the schedule reaches the inner optimizer
    assert len(inner.state) == 4


def test_step_hooks_zero_grad_and_repr():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = gtx.wrap(inner, gtx.chain(gtx.clip_by_value(1.0), gtx.clip_by_global_norm(1.0)), model=model)
    calls = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    inner.register_step_post_hook(lambda o, args, kwargs: calls.append(("inner", o)))
    loss_of(model, 0).backward()
    opt.step()
    assert calls == [("pre", opt), ("inner", inner), ("post", opt)]
    pre.remove()
    opt.step()
    assert [c[0] for c in calls[3:]] == ["inner", "post"]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    text = repr(opt)
    assert text.startswith("ChainedOptimizer") and "chain(clip_by_value, clip_by_global_norm)" in text
    assert "SGD (" in text and "lr: 0.1" in text


def test_step_with_closure_transforms_each_evaluation():
    model, reference = mlp(), mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(0.1))
    ref = torch.optim.SGD(reference.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    ref.zero_grad()
    ref_loss = loss_of(reference, 0)
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    ref.step()
    assert torch.equal(loss, ref_loss) and same_params(model, reference)


def test_add_param_group_names_new_params_and_keeps_existing_state():
    model = mlp()
    head = nn.Linear(3, 2)
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), ema_of_grads(0.5))
    loss_of(model, 0).backward()
    opt.step()
    old = opt.tx_state.ema["group0.param0"]
    opt.add_param_group({"params": head.parameters(), "lr": 0.01})
    assert set(opt.tx_state.ema) == {f"group0.param{i}" for i in range(4)} | {"group1.param0", "group1.param1"}
    assert opt.tx_state.ema["group0.param0"] is old and int(opt.tx_state.count) == 1
    head(model(batch(1)[0])).sum().backward()
    opt.step()
    assert opt.tx_state.ema["group1.param0"].abs().sum() > 0


def test_state_dict_carries_the_chain_state_and_resumes_bit_identically(tmp_path):
    def make(model):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return gtx.wrap(inner, gtx.chain(ema_of_grads(0.8), gtx.clip_by_global_norm(0.5)), model=model)

    straight = mlp()
    opt = make(straight)
    for step in range(6):
        opt.zero_grad()
        loss_of(straight, step).backward()
        opt.step()

    first = mlp()
    opt = make(first)
    for step in range(3):
        opt.zero_grad()
        loss_of(first, step).backward()
        opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, path)
    checkpoint = torch.load(path, weights_only=True)  # tensors and plain containers only
    assert set(checkpoint["opt"]) == {"state", "param_groups"}
    assert "0.ema.0.weight" in checkpoint["opt"]["param_groups"][0][STATE_KEY]

    resumed = mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    opt = make(resumed)
    opt.load_state_dict(checkpoint["opt"])
    for step in range(3, 6):
        opt.zero_grad()
        loss_of(resumed, step).backward()
        opt.step()
    assert same_params(resumed, straight)
    assert list(opt.tx_state[0].ema) == [name for name, _ in resumed.named_parameters()]  # parameter order kept
    for a, b in zip(gtx.tree.leaves(opt.tx_state), gtx.tree.leaves(make(mlp()).tx_state)):
        assert a.shape == b.shape


def test_load_state_dict_of_the_bare_optimizer_and_of_a_different_chain():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, 0).backward()
    inner.step()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ema_of_grads(0.5), model=model)
    opt.load_state_dict(inner.state_dict())  # no chain entry: the inner state loads, the chain keeps its own
    assert len(opt.state) == 4 and int(opt.tx_state.count) == 0
    other = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(1.0), model=model)
    with pytest.raises(ValueError, match="does not fit this transformation"):
        opt.load_state_dict(other.state_dict())


def test_pickling_a_wrap_with_a_transformation_is_refused_clearly():
    import io
    import pickle

    for tx in (gtx.clip_by_global_norm(1.0), gtx.MultiSteps(gtx.scale(1.0), 2)):
        opt = gtx.wrap(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), tx)
        with pytest.raises(TypeError, match=r"with a transformation .* cannot be pickled: transformations are closures\. Save opt\.state_dict\(\)"):
            pickle.dumps(opt)
        with pytest.raises(TypeError, match="cannot be pickled"):
            torch.save(opt, io.BytesIO())
        assert copy.copy(opt).tx is opt.tx
    model = torch.nn.Linear(2, 2)
    plain = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1))  # no transformation: pickles as torch's
    model(torch.ones(1, 2)).sum().backward()
    plain.step()
    again = pickle.loads(pickle.dumps(plain))
    assert again.tx is None and again.param_groups[0]["lr"] == 0.1


def test_deepcopy_gives_an_independent_optimizer():
    model = mlp()
    opt = gtx.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), gtx.clip_by_global_norm(1.0), model=model)
    twin_model, twin = copy.deepcopy((model, opt))
    for m, o in ((model, opt), (twin_model, twin)):
        loss_of(m, 0).backward()
        o.step()
    assert same_params(model, twin_model) and twin.optimizer is not opt.optimizer


# --------------------------------------------------------------------------- GradScaler


def scaled_run(wrapped: bool, inject_at: int, fused: bool = False, explicit_unscale: bool = True):
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    opt = gtx.wrap(inner, gtx.clip_by_global_norm(0.5), model=model) if wrapped else inner
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales, snapshots = [], []
    for step in range(5):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == inject_at:
            model[0].weight.grad[0, 0] = math.inf
        if explicit_unscale or not wrapped:
            scaler.unscale_(opt)
            if not wrapped:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return model, scales, snapshots, opt


@pytest.mark.parametrize("fused,explicit_unscale", [(False, True), (True, True), (False, False), (True, False)])
def test_grad_scaler_skips_inf_steps_and_halves_the_scale(fused, explicit_unscale):
    model, scales, snapshots, opt = scaled_run(True, inject_at=2, fused=fused, explicit_unscale=explicit_unscale)
    assert scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9]
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))  # the inf step changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))  # and training went on
    reference, ref_scales, _, _ = scaled_run(False, inject_at=2, fused=fused)
    assert scales == ref_scales
    if fused:  # folded clip: one rounding from torch's separate pass
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    else:
        assert same_params(model, reference)
    assert int(opt.optimizer.state[model[0].weight]["step"]) == 4


def test_grad_scaler_with_clip_grad_by_norm_between_unscale_and_step():
    model, reference = mlp(), mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2))
    for step in range(4):
        for m, o, s in ((model, opt, scaler), (reference, ref, ref_scaler)):
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            if step == 1:
                m[2].bias.grad[0] = math.nan
            s.unscale_(o)
        norm = opt.clip_grad_by_norm(0.2)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.2)
        assert torch.equal(norm, ref_norm, ) or (norm.isnan() and ref_norm.isnan())
        for o, s in ((opt, scaler), (ref, ref_scaler)):
            s.step(o)
            s.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert same_params(model, reference)
    assert scaler.get_scale() == 2.0**11


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors():
    model = mlp()
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer instance, got Sequential"):
        gtx.wrap(model)
    with pytest.raises(TypeError, match="a class"):
        gtx.wrap(torch.optim.SGD)
    with pytest.raises(TypeError, match="tx must be a GradientTransformation"):
        gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), lambda g: g)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=[1])
    other = mlp(seed=1)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape \(16, 6\)\) is not a parameter of the model"):
        gtx.wrap(torch.optim.SGD(other.parameters(), lr=0.1), gtx.clip_by_global_norm(1.0), model=model)
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(ValueError, match="new param group .* is not a parameter of the model"):
        opt.add_param_group({"params": other.parameters()})
    assert len(opt.param_groups) == 1


def test_a_model_may_hold_parameters_the_optimizer_does_not():
    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model[2].parameters(), lr=0.1), gtx.clip_by_global_norm(1.0), model=model)
    assert sorted(opt.tx_state.norm.shape) == [] and opt._names == ["2.weight", "2.bias"]


def test_a_transformation_changing_a_gradients_shape_is_named():
    def reshape(updates, params):
        return {k: v.reshape(-1) for k, v in updates.items()}

    model = mlp()
    opt = gtx.wrap(torch.optim.SGD(model.parameters(), lr=0.1), gtx.stateless(reshape), model=model)
    loss_of(model, 0).backward()
    with pytest.raises(ValueError, match="'0.weight'"):
        opt.step()
