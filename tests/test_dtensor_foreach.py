"""Foreach arithmetic on DTensors runs on their local shards: DTensor's own numbers, without its dispatch.

DTensor's dispatch propagates the sharding of every foreach call over every tensor of its lists
(seconds for a step's first calls on a 2-D mesh). ``gradtx.tree.foreach`` gives an elementwise
kernel the local shards instead when every DTensor operand at a position is laid out as that
position's DTensor. Here, on a world of one (in this process), each result is compared bit for
bit with the same kernel dispatched on the DTensors, and a ``TorchFunctionMode`` sees which
tensors the kernel got. The arithmetic on several ranks (uneven shards, 2-D meshes) is checked
against dense training by ``examples/muon_fsdp2.py`` and the tests in ``tests/distributed``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from gradtx import tree as tree_lib


@pytest.fixture()
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


class KernelInputs(TorchFunctionMode):
    """Records, for each ``torch._foreach_*`` call, the types of the tensors of its first list."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[type]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_"):
            self.calls.append((name, {type(t) for t in args[0]}))
        return func(*args, **(kwargs or {}))


def _dtensors(mesh, placements, *shapes, seed: int = 0):
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    return [distribute_tensor(torch.randn(*shape, generator=gen), mesh, placements) for shape in shapes]


def _same(results, expected) -> None:
    assert len(results) == len(expected)
    for result, reference in zip(results, expected):
        assert type(result) is type(reference)
        assert result.placements == reference.placements and result.shape == reference.shape
        assert result.dtype == reference.dtype
        assert torch.equal(result.to_local(), reference.to_local())


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_elementwise_ops_run_on_the_shards_with_dtensors_numbers(mesh, placement):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = [Shard(0)] if placement == "shard" else [Replicate()]
    selves = _dtensors(mesh, placements, (5, 3), (7,), seed=0)
    others = _dtensors(mesh, placements, (5, 3), (7,), seed=1)
    third = _dtensors(mesh, placements, (5, 3), (7,), seed=2)
    factor = torch.tensor(0.3, dtype=torch.float64)  # a 0-d plain tensor, of a wider dtype
    replicated = distribute_tensor(torch.tensor(1.5), mesh, [Replicate()])  # a 0-d DTensor
    cases = [  # (name, args, kwargs): the calls gradtx's transforms and tree utilities make
        ("mul", (2.0,), {}),
        ("mul", (factor,), {}),
        ("mul", (replicated,), {}),
        ("mul", (others,), {}),
        ("add", (others,), {"alpha": -0.5}),
        ("div", (others,), {}),
        ("lerp", (others, [factor.float()] * 2), {}),
        ("addcmul", (others, third), {"value": 0.1}),
        ("sqrt", (), {}),
        ("clamp_min", (0.2,), {}),
        ("pow", (3.0,), {}),
    ]
    for name, args, kwargs in cases:
        kernel = getattr(torch, f"_foreach_{name}")
        expected = list(kernel([s.abs() for s in selves], *args, **kwargs))  # dispatched on the DTensors
        with KernelInputs() as seen:
            results = tree_lib.foreach(name, [s.abs() for s in selves], *args, inplace=False, **kwargs)
        _same(results, expected)
        assert seen.calls == [(f"_foreach_{name}", {torch.Tensor})], (name, seen.calls)

        expected_selves = [s.abs() for s in selves]
        getattr(torch, f"_foreach_{name}_")(expected_selves, *args, **kwargs)
        written = [s.abs() for s in selves]
        storages = [w.to_local().data_ptr() for w in written]
        with KernelInputs() as seen:
            results = tree_lib.foreach(name, written, *args, inplace=True, **kwargs)
        assert all(r is w for r, w in zip(results, written))
        assert [w.to_local().data_ptr() for w in written] == storages  # written into the shards
        _same(results, expected_selves)
        assert seen.calls == [(f"_foreach_{name}_", {torch.Tensor})], (name, seen.calls)
    assert all(isinstance(s, DTensor) for s in selves)


def test_other_layouts_are_left_to_dtensor(mesh):
    """An operand laid out otherwise than its position's DTensor (another placement, a broadcast
    shape) or not a scalar (a plain tensor with dims) goes through DTensor's dispatch, as before."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    selves = _dtensors(mesh, [Shard(0)], (4, 2), seed=0)
    replicated = _dtensors(mesh, [Replicate()], (4, 2), seed=1)
    row = [distribute_tensor(torch.randn(2), mesh, [Replicate()])]
    for args in [(replicated,), (row,)]:
        expected = list(torch._foreach_mul(selves, *args))
        with KernelInputs() as seen:
            results = tree_lib.foreach("mul", selves, *args, inplace=False)
        _same(results, expected)
        assert seen.calls and all(types != {torch.Tensor} for _, types in seen.calls), seen.calls
    with pytest.raises(RuntimeError):
        tree_lib.foreach("mul", selves, [torch.randn(4, 2)], inplace=False)
