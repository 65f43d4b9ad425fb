"""Hypothesis-generated layouts on real meshes of 8 ranks: random mesh shapes and names, a random
pipeline axis, leaves split over random axes along random dims (or flat, as ZeRO), spread over
stages, with tied duplicates. gradtx's norms and clips must equal the dense ones.

Every rank draws the same examples (``derandomize``) and the ranks agree on each outcome through
an all-reduce, so shrinking stays in step everywhere."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _world
from _layouts import Piece, check_layout, dense_tree, rules
from _world import case
from gradtx.sharding import ShardingSpec

MESHES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("b", "c")), ((2, 2, 2), ("a", "b", "c"))]


@st.composite
def layouts(draw):
    shape, names = draw(st.sampled_from(MESHES))
    stage_axis = draw(st.sampled_from((None,) + names))
    stages = dict(zip(names, shape))[stage_axis] if stage_axis else 1
    free = [n for n in names if n != stage_axis]
    shapes, pieces = {}, {}
    for i in range(draw(st.integers(1, 5))):
        name = f"leaf{i}"
        leaf_shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        shapes[name] = leaf_shape

        def splits():
            axes = draw(st.lists(st.sampled_from(free), unique=True, max_size=len(free))) if free else []
            out = []
            for axis in axes:
                dim = draw(st.one_of(st.none(), st.integers(0, len(leaf_shape) - 1)))
                out.append(((axis,), dim))
            return tuple(out)

        stage = draw(st.integers(0, stages - 1)) if stage_axis else None
        pieces[name] = Piece(name, splits(), stage)
        if draw(st.booleans()) and draw(st.booleans()):  # a tied copy, laid out its own way
            copy_stage = draw(st.integers(0, stages - 1)) if stage_axis else None
            pieces[f"tied{i}"] = Piece(name, splits(), copy_stage, duplicate=True)
    return shape, names, stage_axis, shapes, pieces


def _agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@case(8)
def random_layouts(world):
    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(layouts())
    def prop(layout):
        shape, names, stage_axis, shapes, pieces = layout
        mesh = world.mesh(shape, names)
        spec = ShardingSpec(mesh, rules(pieces), stage_axis=stage_axis)
        error = None
        try:
            check_layout(dense_tree(shapes), pieces, mesh, spec, stage_axis=stage_axis)
        except AssertionError as e:
            error = e
        if not _agree(error is None):
            raise error or AssertionError("another rank disagrees with the dense result")

    prop()


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_properties(size, name):
    _world.check(size, name)
