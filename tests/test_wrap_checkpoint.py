"""wrap's state dict through torch's checkpoint APIs, single process.

``torch.distributed.checkpoint.state_dict.get_state_dict`` keeps only an optimizer state dict's
``state`` and ``param_groups``, and steps an optimizer without state once to create it; the
chain's state must survive the first and not move in the second. ``load_state_dict`` is all or
nothing. (Under FSDP2 on two ranks: ``tests/integrations/test_dcp_fsdp2.py``.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gradtx as gtx
from gradtx.interop.wrap import STATE_KEY

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    return nn.functional.cross_entropy(model(x), y)


def stateful_chain() -> gtx.GradientTransformation:
    """Every piece keeps counters: a clip, a scheduled scale, accumulation over 2 calls, a finite check."""
    scheduled = gtx.inject_hyperparams(gtx.scale)(step_size=gtx.linear_schedule(1.0, 0.25, 6))
    return gtx.apply_if_finite(
        gtx.MultiSteps(gtx.chain(gtx.clip_by_global_norm(0.5), scheduled), 2).gradient_transformation(), 3
    )


def make(model: nn.Module, inner: str = "adamw") -> gtx.ChainedOptimizer:
    if inner == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:  # no state of its own: DCP's initialising step runs on the live optimizer too
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return gtx.wrap(opt, stateful_chain(), model=model)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    opt.zero_grad()


def leaves_equal(a, b) -> bool:
    la, lb = gtx.tree.leaves(a), gtx.tree.leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def assert_unchanged(target: gtx.ChainedOptimizer, inner_before: dict, chain_before) -> None:
    """Neither the inner optimizer's state dict nor the chain's state moved."""
    after = target.optimizer.state_dict()
    assert leaves_equal(after["state"], inner_before["state"])
    assert after["param_groups"] == inner_before["param_groups"]
    assert leaves_equal(target.tx_state, chain_before)


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_get_and_set_state_dict_resume_exactly(inner, tmp_path):
    straight = mlp()
    opt = make(straight, inner)
    train(straight, opt, range(7))

    first = mlp()
    opt = make(first, inner)
    train(first, opt, range(3))  # mid-accumulation: one gradient waits in MultiSteps
    before = copy.deepcopy(opt.tx_state)
    model_sd, optim_sd = get_state_dict(first, opt)
    assert leaves_equal(opt.tx_state, before), "get_state_dict's initialising step advanced the chain"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    train(first, opt, range(3, 7))  # the run that saved goes on unchanged
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), straight.parameters()))

    resumed = mlp(seed=7)
    opt = make(resumed, inner)
    model_sd, optim_sd = get_state_dict(resumed, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert int(opt.tx_state.inner_state.mini_step) == 1
    train(resumed, opt, range(3, 7))
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), straight.parameters()))


def test_get_state_dict_keeps_the_chain_state():
    model = mlp()
    opt = make(model)
    train(model, opt, range(3))
    _, optim_sd = get_state_dict(model, opt)
    saved = optim_sd["param_groups"][0][STATE_KEY]
    live = dict(zip(gtx.tree.paths(opt.tx_state), gtx.tree.leaves(opt.tx_state)))
    assert set(saved) == set(live) and all(torch.equal(saved[path], live[path]) for path in live)


def corrupt(state_dict: dict, path: str, value) -> dict:
    state_dict = copy.deepcopy(state_dict)
    chain_state = state_dict["param_groups"][0][STATE_KEY]
    if value is None:
        del chain_state[path]
    else:
        chain_state[path] = value
    return state_dict


@pytest.mark.parametrize("what", ["missing", "extra", "shape", "dtype", "kind"])
def test_load_state_dict_that_does_not_fit_changes_nothing(what):
    model = mlp()
    opt = make(model)
    train(model, opt, range(3))
    good = copy.deepcopy(opt.state_dict())

    other = mlp(seed=3)
    target = make(other)
    train(other, target, range(5))
    inner_before = copy.deepcopy(target.optimizer.state_dict())
    chain_before = copy.deepcopy(target.tx_state)

    paths = list(good["param_groups"][0][STATE_KEY])
    counter = next(p for p in paths if p.endswith("mini_step"))
    accumulator = next(p for p in paths if "acc_grads" in p)
    bad = {
        "missing": lambda: corrupt(good, counter, None),
        "extra": lambda: corrupt(good, "no.such.leaf", torch.zeros(())),
        "shape": lambda: corrupt(good, accumulator, torch.zeros(2, 2)),
        "dtype": lambda: corrupt(good, counter, torch.zeros((), dtype=torch.float64)),
        "kind": lambda: corrupt(good, counter, 3),
    }[what]()
    with pytest.raises(ValueError, match="transformation state"):
        target.load_state_dict(bad)
    assert_unchanged(target, inner_before, chain_before)
    target.load_state_dict(good)  # and the good one still loads
    assert leaves_equal(target.tx_state, opt.tx_state)


def test_older_checkpoints_with_a_top_level_entry_load():
    model = mlp()
    opt = make(model)
    train(model, opt, range(3))
    sd = opt.state_dict()
    groups = [dict(g) for g in sd["param_groups"]]
    chain_state = groups[0].pop(STATE_KEY)
    old_format = {"state": sd["state"], "param_groups": groups, STATE_KEY: {"tx_state": chain_state}}
    target = make(mlp(seed=3))
    target.load_state_dict(old_format)
    assert leaves_equal(target.tx_state, opt.tx_state)


@pytest.mark.parametrize("source", ["a copy", "dcp.load into a fresh dict"])
def test_a_flattened_state_dict_that_is_not_the_live_one_keeps_the_chain_state(source, tmp_path):
    """torchtitan's setting (flatten_optimizer_state_dict=True): the chain's state survives a round trip
    through a dict other than the live one, and the run resumes as if uninterrupted."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    straight = mlp()
    straight_opt = make(straight)
    train(straight, straight_opt, range(6))

    model = mlp()
    opt = make(model)
    train(model, opt, range(3))
    _, optim_sd = get_state_dict(model, opt, options=flat)
    target_model = mlp(seed=3)
    target = make(target_model)
    if source == "a copy":
        loaded = copy.deepcopy(optim_sd)
    else:
        dcp.save({"optim": optim_sd}, checkpoint_id=str(tmp_path))
        _, loaded = get_state_dict(target_model, target, options=flat)
        loaded = copy.deepcopy(loaded)  # not the live tensors: dcp.load writes into this copy only
        dcp.load({"optim": loaded}, checkpoint_id=str(tmp_path))
    set_state_dict(target_model, target, model_state_dict=model.state_dict(), optim_state_dict=loaded, options=flat)
    assert leaves_equal(target.tx_state, opt.tx_state)
    train(target_model, target, range(3, 6))
    for p, q in zip(target_model.parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_state_dict_without_the_chain_state_warns_and_keeps_the_current_one():
    import warnings

    model = mlp()
    opt = make(model)
    train(model, opt, range(3))
    bare = opt.optimizer.state_dict()  # the inner optimizer's own: no chain state in it
    target_model = mlp(seed=3)
    target = make(target_model)
    before = copy.deepcopy(target.tx_state)
    with pytest.warns(UserWarning, match="no transformation state"):
        set_state_dict(target_model, target, model_state_dict=model.state_dict(), optim_state_dict=_by_name(model, bare))
    assert leaves_equal(target.tx_state, before)

    _, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        set_state_dict(target_model, target, model_state_dict=model.state_dict(), optim_state_dict=optim_sd)
    assert leaves_equal(target.tx_state, opt.tx_state)


def _by_name(model: nn.Module, state_dict: dict) -> dict:
    """An optimizer state dict keyed by parameter name, as get_state_dict returns it."""
    names = [name for name, _ in model.named_parameters()]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]]
    groups = [{k: v for k, v in g.items() if k != STATE_KEY} for g in groups]
    return {"state": {names[i]: v for i, v in state_dict["state"].items()}, "param_groups": groups}


def test_a_users_step_with_zero_gradients_and_learning_rate_still_advances_the_chain():
    model = mlp()
    opt = make(model, "sgd")
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # looks like DCP's initialising step, but is the user's
    assert int(opt.tx_state.inner_state.mini_step) == 1


def _inner_case(what: str):
    """``(optimizer factory, a corruption of a good state dict, whether it must be refused)``."""

    def set_state(key, value):
        def corrupt_it(sd):
            sd["state"][0][key] = value
            return sd

        return corrupt_it

    def drop_group_key(key):
        def corrupt_it(sd):
            del sd["param_groups"][0][key]
            return sd

        return corrupt_it

    def drop_state_key(key):
        def corrupt_it(sd):
            del sd["state"][1][key]
            return sd

        return corrupt_it

    def step_as_number(sd):
        for entry in sd["state"].values():
            entry["step"] = float(entry["step"])
        return sd

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adafactor = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)  # noqa: E731
    return {
        "adamw exp_avg of another size": (adamw, set_state("exp_avg", torch.zeros(3)), True),
        "sgd momentum buffer of another size": (sgd, set_state("momentum_buffer", torch.zeros(16, 5)), True),
        "a group without lr": (adamw, drop_group_key("lr"), True),
        "a group without betas": (adamw, drop_group_key("betas"), True),
        "adafactor row_var of another size": (adafactor, set_state("row_var", torch.zeros(7)), True),
        "adamw state without step": (adamw, drop_state_key("step"), True),
        "an older group without foreach": (adamw, drop_group_key("foreach"), False),
        "an older state with a number for step": (adamw, step_as_number, False),
    }[what]


@pytest.mark.parametrize(
    "what",
    [
        "adamw exp_avg of another size",
        "sgd momentum buffer of another size",
        "a group without lr",
        "a group without betas",
        "adafactor row_var of another size",
        "adamw state without step",
        "an older group without foreach",
        "an older state with a number for step",
    ],
)
@pytest.mark.parametrize("target_has_state", [False, True], ids=["fresh target", "trained target"])
def test_an_inner_state_that_does_not_fit_is_refused_before_anything_loads(what, target_has_state):
    make_inner, corrupt_it, refused = _inner_case(what)
    model = mlp()
    opt = gtx.wrap(make_inner(model.parameters()), stateful_chain(), model=model)
    train(model, opt, range(4))
    bad = corrupt_it(copy.deepcopy(opt.state_dict()))

    other = mlp(seed=3)
    target = gtx.wrap(make_inner(other.parameters()), stateful_chain(), model=other)
    if target_has_state:
        train(other, target, range(2))
    inner_before = copy.deepcopy(target.optimizer.state_dict())
    chain_before = copy.deepcopy(target.tx_state)
    if not refused:
        target.load_state_dict(bad)
        train(other, target, range(4, 6))  # and the next steps run
        return
    with pytest.raises(ValueError, match="wrap: .*(state dict|param group)"):
        target.load_state_dict(bad)
    assert_unchanged(target, inner_before, chain_before)
