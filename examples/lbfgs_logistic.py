"""L-BFGS through gradtx's extra arguments: logistic regression on scikit-learn's breast-cancer data.

The objective is a plain function of a params dict. gradtx's ``lbfgs()`` is optax's: the L-BFGS
direction, then a zoom line search (strong Wolfe conditions) that calls the objective itself, so
``update`` is given the objective through its extra arguments:

    value, grad = value_and_grad(params, state=state)      # reuses what the line search computed
    updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=loss_fn)
    params = gtx.apply_updates(params, updates)

It is compared with ``torch.optim.LBFGS(line_search_fn="strong_wolfe")`` with the same memory, one
iteration per ``step``. For each the script prints the iterations needed to bring the loss within
``TOLERANCE`` of the optimum (found beforehand by a long run), the objective evaluations spent,
and the final loss.

Run:  python examples/lbfgs_logistic.py            (a few seconds on 2 CPU cores; no download)
      python examples/lbfgs_logistic.py --quick    (fewer iterations, as the tests run it;
                                                     so does GRADTX_EXAMPLES_QUICK=1)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer

import gradtx as gtx

L2 = 1e-3  # a little ridge penalty: the optimum is unique and finite
MEMORY = 10
TOLERANCE = 1e-6


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    """569 tumours, 30 features each (shipped with scikit-learn), standardised; labels 0/1."""
    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float64)
    x = (x - x.mean(0)) / x.std(0)
    return x, torch.tensor(data.target, dtype=torch.float64)


def make_loss(x: torch.Tensor, y: torch.Tensor):
    def loss_fn(params: dict) -> torch.Tensor:
        logits = x @ params["w"] + params["b"]
        return F.binary_cross_entropy_with_logits(logits, y) + 0.5 * L2 * (params["w"] ** 2).sum()

    return loss_fn


def zeros(num_features: int) -> dict:
    return {"w": torch.zeros(num_features, dtype=torch.float64), "b": torch.zeros((), dtype=torch.float64)}


def run_gradtx(loss_fn, params: dict, iterations: int) -> tuple[list[float], int]:
    """gradtx's ``lbfgs()``; returns the loss after each iteration and the objective evaluations."""
    evaluations = 0

    def counted(p):
        nonlocal evaluations
        evaluations += 1
        return loss_fn(p)

    opt = gtx.lbfgs(memory_size=MEMORY)
    state = opt.init(params)
    value_and_grad = gtx.value_and_grad_from_state(counted)
    losses = []
    for _ in range(iterations):
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=counted)
        params = gtx.apply_updates(params, updates)
        losses.append(float(state[-1].value))  # the line search's value at the new params
    return losses, evaluations


def run_torch(loss_fn, params: dict, iterations: int) -> tuple[list[float], int]:
    """``torch.optim.LBFGS`` with its strong Wolfe line search, one iteration per ``step``.

    Each ``step`` evaluates the objective once at its start (again at the point the previous line
    search ended on), so its evaluations count one per iteration more than a single long ``step``.
    """
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.LBFGS(
        list(tensors.values()),
        lr=1.0,
        max_iter=1,
        max_eval=1 + 25,  # the budget goes to the line search (max_ls = max_eval - 1); the default, 1, leaves it none
        history_size=MEMORY,
        line_search_fn="strong_wolfe",
        tolerance_grad=0.0,
        tolerance_change=0.0,
    )
    evaluations = 0

    def closure():
        nonlocal evaluations
        evaluations += 1
        opt.zero_grad()
        loss = loss_fn(tensors)
        loss.backward()
        return loss

    losses = []
    for _ in range(iterations):
        opt.step(closure)
        with torch.no_grad():
            losses.append(float(loss_fn(tensors)))
    return losses, evaluations


def first_within(losses: list[float], target: float) -> str:
    for i, loss in enumerate(losses, start=1):
        if loss <= target:
            return str(i)
    return f"not within {len(losses)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (as the tests run it)")
    parser.add_argument("--iterations", type=int, default=None)
    args = parser.parse_args()
    quick = args.quick or os.environ.get("GRADTX_EXAMPLES_QUICK") == "1"
    iterations = args.iterations or (30 if quick else 100)

    torch.manual_seed(0)
    x, y = load_data()
    loss_fn = make_loss(x, y)
    print(f"breast cancer: {x.shape[0]} samples, {x.shape[1]} standardised features, L2 = {L2}")

    long_run = 3 * iterations
    optimum = min(run_torch(loss_fn, zeros(x.shape[1]), long_run)[0] + run_gradtx(loss_fn, zeros(x.shape[1]), long_run)[0])
    target = optimum + TOLERANCE
    print(f"optimum (long runs of both): {optimum:.10f}; target: loss <= optimum + {TOLERANCE:g}")

    results = {
        "gradtx lbfgs()": run_gradtx(loss_fn, zeros(x.shape[1]), iterations),
        "torch.optim.LBFGS": run_torch(loss_fn, zeros(x.shape[1]), iterations),
    }
    for name, (losses, evaluations) in results.items():
        print(
            f"{name:18s} iterations to reach target: {first_within(losses, target):>4s}   "
            f"final loss after {iterations} iterations: {losses[-1]:.10f} (optimum + {losses[-1] - optimum:.1e})   "
            f"objective evaluations: {evaluations}"
        )


if __name__ == "__main__":
    main()
