"""Sharding specs: how each gradient leaf is laid out across ranks, and the exact reductions.

``ShardingSpec(mesh, leaves, stage_axis=...)`` declares the layout of plain tensors (``Shard`` /
``Replicate`` leaf specs); DTensors describe themselves. ``global_norm`` counts every logical
element once with one collective; ``leaf_norms`` / ``leaf_rms`` / ``unitwise_norms`` give per-leaf
quantities of the logical tensors, batched into one collective per distinct group;
``global_sums`` gives exact inner products and other sums over the logical tree.
``map_logical`` applies a function to every leaf as a whole logical tensor (Muon's
orthogonalization) and gives each rank its slice, with a fixed number of collectives per call.
Ranks that disagree (trees, shapes, rules, options) get the same error on every rank
(:mod:`~gradtx.sharding.consistency`); a rank that strays in a steady-state step is caught by the
flags its norm's all-reduce carries, and waits are bounded (:mod:`~gradtx.sharding.waiting`);
sharded steps compile once an eager call has checked them (:mod:`~gradtx.sharding.compiling`).
"""

from gradtx.sharding.decisions import all_finite, any_rank, count_not_finite
from gradtx.sharding.dtensor import has_dtensor, locals_of
from gradtx.sharding.matrices import logical_shapes, map_logical
from gradtx.sharding.probe import finiteness_probe
from gradtx.sharding.placements import LeafSpec, Replicate, Shard
from gradtx.sharding.reductions import global_norm, is_sharded, leaf_norms, leaf_rms, unitwise_norms
from gradtx.sharding.spec import ShardingSpec
from gradtx.sharding.sums import global_sums

__all__ = [
    "LeafSpec",
    "Replicate",
    "Shard",
    "ShardingSpec",
    "all_finite",
    "any_rank",
    "count_not_finite",
    "finiteness_probe",
    "global_norm",
    "global_sums",
    "has_dtensor",
    "is_sharded",
    "leaf_norms",
    "leaf_rms",
    "locals_of",
    "logical_shapes",
    "map_logical",
    "unitwise_norms",
]
