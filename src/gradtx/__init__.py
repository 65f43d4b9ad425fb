"""gradtx: pure, composable gradient transformations for PyTorch, exact under any sharding."""

from gradtx import schedules, sharding, tree
from gradtx.base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    identity,
    stateless,
    stateless_with_tree_map,
)
from gradtx.chains import (
    ApplyIfFiniteState,
    ChainedOptimizer,
    EmaMeasureState,
    FromTorchState,
    InjectHyperparamsState,
    MaskedState,
    MonitorState,
    MultiSteps,
    MultiStepsState,
    PartitionState,
    SnapshotState,
    apply_if_finite,
    chain,
    freeze,
    from_torch,
    get_measurement,
    inject_hyperparams,
    masked,
    measure_with_ema,
    monitor,
    multi_transform,
    named_chain,
    partition,
    selective_transform,
    skip_large_updates,
    skip_not_finite,
    snapshot,
    wrap,
)
from gradtx.transforms import (
    ClipByGlobalNormState,
    adaptive_grad_clip,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    clip_by_value,
    global_norm,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
    unitwise_norm,
)
from gradtx.schedules import (
    Schedule,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
)

__version__ = "0.1.0"
