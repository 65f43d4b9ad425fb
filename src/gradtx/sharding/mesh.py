"""A device mesh seen as named axes: this rank's coordinates and process groups over sets of axes.

Everything else in ``gradtx.sharding`` speaks of axes by name; this module turns names into ranks
and groups. Groups spanning several axes are created when the axes are first named, for every set
of two or more axes at once, on every rank in the same order (as a ``DeviceMesh`` creates its own
groups), and cached for the life of the default process group, so steps create nothing and a rank
never names a group its peers named differently.

Users of Megatron-LM, DeepSpeed or another framework that already owns its process groups build the
mesh from them with ``DeviceMesh.from_group`` (see :class:`gradtx.sharding.ShardingSpec`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# (default group, ranks) -> process group (or torch's non-member marker on ranks outside it). Keyed
# by the default group too, so a test that destroys and re-creates the world never reuses a dead
# group. Every rank fills it in the same order, so every rank finds the same keys.
_GROUPS: dict[tuple[Any, ...], Any] = {}
# The same for meshes over part of the world, whose groups only their members create, when needed.
_LOCAL_GROUPS: dict[tuple[Any, ...], Any] = {}


def _world_key() -> int:
    return id(dist.group.WORLD)


def _agree_on_group_count(device: torch.device) -> None:
    """Gives every rank the highest count of groups made so far, before groups all ranks create.

    Torch names a group all ranks create by its count of groups made. From torch 2.14 a group
    that only its members create (``new_group(..., use_local_synchronization=True)``) advances the
    count on those members alone, so every group all ranks create afterwards gets different names
    on different ranks and never forms (a timeout, 30 minutes by default). Names need only agree and
    be unique, so every rank takes the highest count (one ``all_reduce``, when the groups are made).
    Where torch keeps no such count, there is nothing to agree on."""
    state = getattr(dist.distributed_c10d, "_world", None)
    if not isinstance(getattr(state, "group_count", None), int):
        return
    count = torch.tensor([state.group_count], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    state.group_count = int(count.item())


class MeshAxes:
    """The named axes of ``mesh``, this rank's coordinate on each, and groups over axis sets."""

    def __init__(self, mesh: DeviceMesh, *, require_names: bool, owner: str = "ShardingSpec"):
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{owner}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        names = mesh.mesh_dim_names
        if names is None:
            if require_names:
                raise ValueError(
                    f"{owner}: the mesh has no axis names; build it with mesh_dim_names, e.g. "
                    "init_device_mesh('cuda', (2, 4), mesh_dim_names=('dp', 'tp'))"
                )
            names = tuple(f"dim{i}" for i in range(mesh.ndim))
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"{owner}: this rank ({dist.get_rank()}) is not part of the mesh {mesh}")
        self.mesh = mesh
        self.names: tuple[str, ...] = tuple(names)
        self.sizes: dict[str, int] = dict(zip(self.names, mesh.shape))
        self.coordinate: dict[str, int] = dict(zip(self.names, coordinate))
        self._grid: torch.Tensor = mesh.mesh.cpu()
        self._rank_coordinate: dict[int, tuple[int, ...]] = {
            int(self._grid[index]): index for index in itertools.product(*(range(n) for n in self._grid.shape))
        }
        self._spans: dict[tuple[Any, int], tuple[str, ...]] = {}
        self._create_groups()

    def _create_groups(self) -> None:
        """Creates the group of every set of two or more axes, through every rank of the mesh.

        Torch names a group by how many its creator has made, so groups created on demand would
        get different names on ranks whose histories differ (a stage that has made a group of its
        own, say), and their creation would hang. Made here, every rank makes every group, in mesh
        order, like the mesh's own groups, once the ranks agree on that count
        (:func:`_agree_on_group_count`). A mesh over part of the world cannot do that (ranks
        outside it never get here): its members create their groups on demand instead.
        """
        sized = [name for name in self.names if self.sizes[name] > 1]
        world = dist.get_world_size()
        if len(sized) < 2 or self._grid.numel() != world:
            return
        positions = {name: i for i, name in enumerate(self.names)}
        agreed = False
        for count in range(2, len(sized) + 1):
            for axes in itertools.combinations(sized, count):
                spanned = [positions[name] for name in axes]
                others = [i for i in range(self._grid.ndim) if i not in spanned]
                blocks = self._grid.permute(*others, *spanned).reshape(-1, math.prod(self.sizes[a] for a in axes))
                for block in blocks.tolist():
                    key = (_world_key(), tuple(sorted(block)))
                    if key not in _GROUPS:
                        if not agreed and len(block) != world:
                            _agree_on_group_count(self.device())
                            agreed = True
                        _GROUPS[key] = dist.group.WORLD if len(block) == world else dist.new_group(sorted(block))

    def device(self) -> torch.device:
        """The device this rank's collectives over the mesh use (the current CUDA device on a CUDA mesh)."""
        kind = self.mesh.device_type
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, getattr(torch, kind).current_device())

    # ------------------------------------------------------------------ axes

    def ordered(self, axes: Sequence[str]) -> tuple[str, ...]:
        """``axes`` without repeats, in mesh order."""
        wanted = set(axes)
        return tuple(name for name in self.names if name in wanted)

    def ranks(self, axes: Sequence[str]) -> list[int]:
        """The ranks that share this rank's coordinates on every axis outside ``axes``."""
        index = tuple(slice(None) if name in axes else self.coordinate[name] for name in self.names)
        return sorted(int(r) for r in self._grid[index].reshape(-1))

    def group(self, axes: Sequence[str]) -> Optional[Any]:
        """The process group over ``axes`` containing this rank; ``None`` when it is just this rank."""
        axes = tuple(a for a in self.ordered(axes) if self.sizes[a] > 1)
        if not axes:
            return None
        if len(axes) == 1:
            # by index: a mesh without names (FSDP2's default) has no dim to look up by name
            return self.mesh.get_group(self.names.index(axes[0]))
        key = (_world_key(), tuple(self.ranks(axes)))
        group = _GROUPS.get(key)
        if group is None:  # a mesh over part of the world
            group = _LOCAL_GROUPS.get(key)
            if group is None:
                group = _LOCAL_GROUPS[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
        return group

    def group_ranks(self, axes: Sequence[str]) -> list[int]:
        return self.ranks(tuple(a for a in self.ordered(axes) if self.sizes[a] > 1))

    # ------------------------------------------------------------------ other meshes

    def axes_of_mesh_dim(self, mesh: DeviceMesh, dim: int, *, where: str) -> tuple[str, ...]:
        """The axes of this mesh that ``mesh``'s dim ``dim`` spans (a slice or a flattening of them).

        Found from the ranks alone, so any mesh cut from the same root works (``mesh["dp"]``,
        ``mesh["dp", "cp"]._flatten()``). A dim that is not a full sub-grid of this mesh through
        this rank is a ``ValueError``.
        """
        key = (mesh, dim)
        cached = self._spans.get(key)
        if cached is not None:
            return cached
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"{where}: this rank is not part of the DTensor's mesh {mesh}")
        index = tuple(slice(None) if d == dim else c for d, c in enumerate(coordinate))
        ranks = [int(r) for r in mesh.mesh.cpu()[index].reshape(-1)]
        missing = [r for r in ranks if r not in self._rank_coordinate]
        if missing:
            raise ValueError(
                f"{where}: the DTensor's mesh dim {self._dim_name(mesh, dim)!r} holds rank {missing[0]}, which "
                f"the reference mesh {self.mesh} lacks; use meshes sliced from one root mesh"
            )
        coordinates = [self._rank_coordinate[r] for r in ranks]
        spanned = tuple(
            name for i, name in enumerate(self.names) if len({c[i] for c in coordinates}) > 1
        )
        if sorted(ranks) != self.ranks(spanned):
            raise ValueError(
                f"{where}: the DTensor's mesh dim {self._dim_name(mesh, dim)!r} (ranks {ranks}) is not a "
                f"slice of the reference mesh {self.mesh}"
            )
        self._spans[key] = spanned
        return spanned

    @staticmethod
    def _dim_name(mesh: DeviceMesh, dim: int) -> str:
        names = mesh.mesh_dim_names
        return names[dim] if names else f"dim{dim}"
