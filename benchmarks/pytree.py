"""The pytree backend: optree against ``torch.utils._pytree`` on a 500-leaf dict of tensors.

Times flatten, unflatten, map (identity) and flatten-with-paths, each backend as gradtx would call
it (optree with ``None`` as a leaf in gradtx's namespace), in interleaved rounds
(``common.interleaved``); also gradtx's own ``tree.paths`` (dotted strings, cached per structure).
Prints microseconds per call and the median ratio of ``torch.utils._pytree`` to optree.

Run from the repository root::

    python benchmarks/pytree.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "src"), _ROOT]  # runs from a checkout

import optree  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as torch_pytree  # noqa: E402

from benchmarks.common import interleaved, report  # noqa: E402
from gradtx import tree as tree_lib  # noqa: E402

N_LEAVES = 500
CALLS = 20  # calls per timed sample: one call is too short for the clock on a noisy machine


def parameter_dict(n_leaves: int = N_LEAVES) -> dict[str, torch.Tensor]:
    """A flat dict keyed like ``named_parameters()``: ``"layers.{i}.{name}"``."""
    names = ["attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias", "mlp.fc.weight"]
    return {f"layers.{i // len(names)}.{names[i % len(names)]}": torch.zeros(1) for i in range(n_leaves)}


def optree_ops(tree: dict) -> dict[str, Callable[[], object]]:
    kw = dict(none_is_leaf=True, namespace="gradtx")
    leaves, spec = optree.tree_flatten(tree, **kw)
    return {
        "flatten": lambda: optree.tree_flatten(tree, **kw),
        "unflatten": lambda: optree.tree_unflatten(spec, leaves),
        "map": lambda: optree.tree_map(lambda x: x, tree, **kw),
        "flatten with paths": lambda: optree.tree_flatten_with_path(tree, **kw),
    }


def torch_ops(tree: dict) -> dict[str, Callable[[], object]]:
    leaves, spec = torch_pytree.tree_flatten(tree)
    return {
        "flatten": lambda: torch_pytree.tree_flatten(tree),
        "unflatten": lambda: torch_pytree.tree_unflatten(leaves, spec),
        "map": lambda: torch_pytree.tree_map(lambda x: x, tree),
        "flatten with paths": lambda: torch_pytree.tree_flatten_with_path(tree),
    }


def repeated(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(CALLS):
            fn()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (30 if args.quick else 200)
    tree = parameter_dict()
    mine, theirs = optree_ops(tree), torch_ops(tree)
    print(f"optree {optree.__version__}, torch {torch.__version__}; {N_LEAVES}-leaf dict, {rounds} rounds of {CALLS} calls")
    rows = []
    for op in mine:
        times = interleaved({f"optree {op}": repeated(mine[op]), f"torch.utils._pytree {op}": repeated(theirs[op])}, rounds=rounds, warmup=3)
        if op == "flatten with paths":
            times["gradtx tree.paths (cached per structure)"] = interleaved({"p": repeated(lambda: tree_lib.paths(tree))}, rounds=rounds)["p"]
        ratios = report(f"{op} ({CALLS} calls per sample)", times, f"optree {op}")
        rows.append((op, {name: statistics.median(ts) / CALLS * 1e6 for name, ts in times.items()}, ratios))
    print("\n| operation | optree (µs) | torch.utils._pytree (µs) | torch / optree |")
    print("| --- | ---: | ---: | ---: |")
    for op, micros, ratios in rows:
        print(f"| {op} | {micros[f'optree {op}']:.1f} | {micros[f'torch.utils._pytree {op}']:.1f} | {ratios[f'torch.utils._pytree {op}']:.2f} |")


if __name__ == "__main__":
    main()
