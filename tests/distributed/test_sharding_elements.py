"""gradtx.sharding.elements under real gloo worlds: each rank's logical element indices are its
cut of the dense leaf's row-major indices, for flat ZeRO pieces (even and uneven), uneven plain
pieces along dim 0 and dim 1 (numpy's array_split), replicated leaves and uneven FSDP2 DTensors;
bad layouts are the same error on every rank."""

from __future__ import annotations

import pytest
import torch

import _world
from _layouts import Piece, cut
from _world import case
import gradtx as gtx
from gradtx.sharding import ShardingSpec, elements

SHAPES = {"flat_w": (5, 3), "flat_b": (8,), "rows": (5, 4), "cols": (3, 7), "whole": (2, 3)}


def dense_indices(shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)


def check(tree: dict, pieces_of: list, want: dict) -> None:
    for name, piece in zip(gtx.tree.paths(tree), pieces_of):
        leaf = tree[name]
        got = elements.logical_indices(piece, leaf.shape, leaf.device)
        assert torch.equal(got, want[name]), (name, piece, got, want[name])


@case(2, 4)
def plain_pieces_of_every_kind_index_their_dense_elements(world):
    for mesh_shape, names in (((world.size,), ("dp",)), ((2, world.size // 2), ("rep", "dp"))):
        mesh = world.mesh(mesh_shape, names)
        pieces = {
            "flat_w": Piece("flat_w", ((("dp",), None),)),  # 15 elements: uneven over 2 and 4
            "flat_b": Piece("flat_b", ((("dp",), None),)),  # 8: even
            "rows": Piece("rows", ((("dp",), 0),)),  # 5 rows as 3, 2 / 2, 1, 1, 1 (not DTensor's chunking)
            "cols": Piece("cols", ((("dp",), 1),)),  # 7 columns, uneven
            "whole": Piece("whole"),
        }
        spec = ShardingSpec(mesh, [(name, piece.spec()) for name, piece in pieces.items()])
        tree = {name: cut(torch.zeros(shape), pieces[name], mesh) for name, shape in SHAPES.items()}
        want = {name: cut(dense_indices(shape), pieces[name], mesh) for name, shape in SHAPES.items()}
        found = elements.element_pieces(tree, spec, what="test")
        check(tree, found, want)
        by_name = dict(zip(gtx.tree.paths(tree), found))
        assert by_name["flat_w"].shape == (15,) and by_name["whole"].axes == ()
        assert elements.element_pieces(tree, spec, what="test") == found  # cached: no second exchange


@case(2, 4)
def uneven_dtensors_index_their_dense_elements(world):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = world.mesh((world.size,), ("dp",))
    shapes = {"w": (5, 3), "v": (7,)}
    tree = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)], src_data_rank=None) for k, s in shapes.items()}
    want = {k: distribute_tensor(dense_indices(s), mesh, [Shard(0)], src_data_rank=None).to_local() for k, s in shapes.items()}
    local = {k: v.to_local() for k, v in tree.items()}
    check(local, elements.element_pieces(tree, None, what="test"), want)


@case(2)
def bad_plain_layouts_are_one_error_everywhere(world):
    from test_sharding_disagreement import _everyone_raises

    mesh = world.mesh((world.size,), ("dp",))
    spec = ShardingSpec(mesh, [("w", Piece("w", ((("dp",), None),)).spec())])
    tree = {"w": torch.zeros(2, 3)}  # a flat piece must be 1-D
    message = _everyone_raises(world, lambda: elements.element_pieces(tree, spec, what="probe"), r"probe: leaf 'w' .* not 1-D")
    assert "found on rank 0" in message
    spec = ShardingSpec(mesh, [("w", Piece("w", ((("dp",), 0),)).spec())])
    odd = {"w": torch.zeros(2, 3 + world.rank)}  # pieces along dim 0 whose other dim differs
    _everyone_raises(world, lambda: elements.element_pieces(odd, spec, what="probe"), r"probe: leaf 'w': the pieces do not form a grid")


@pytest.mark.distributed
@pytest.mark.parametrize("size,name", _world.params_for(__name__))
def test_sharding_elements(size, name):
    _world.check(size, name)
