"""A quantized Adam step taken on the stored moments directly, never reading them back as a whole.

Where the inner transformation is an Adam step that declares it (:func:`gradtx.native.stored_adam.declare`:
``adam``, ``adamw``, ``fused_adam`` without Nesterov, ``eps_root`` or a low-precision ``mu``), the
storage is 8 bits and every stored leaf suits the kernel, :func:`update_directly` runs the inner
update once on the whole tree, with the stored leaves' placeholders left in its state: the Adam
step reads each stored leaf's codes, steps and encodes it a block at a time
(:mod:`gradtx.native.stored_adam`), and the leaves it keeps in float32 (small ones) step as usual.
The numbers are those of reading back, stepping and storing (:mod:`~gradtx.quantization.streaming`),
bit for bit; the memory a step adds is its new updates and codes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradtx import tree as tree_lib
from gradtx.native import stored_adam
from gradtx.quantization.streaming import Step
from gradtx.sharding import dtensor as dtensor_lib


def update_directly(step: Step) -> Optional[tuple[Any, list[Any], list[list[Any]], list[list[Any]]]]:
    """The ``step`` of :func:`gradtx.quantize_state` of a declared Adam step (see the module's
    docstring), or ``None`` where it does not apply (the caller then reads the moments back).
    Returns the new updates, the new inner state's leaves, codes and scales."""
    inner_update, updates, params, leaves, state_def, starts, codes, scales, signed, fmt, inplace, extra_args, check = step
    if len(starts) != 2 or stored_adam.usable() is None or torch.is_grad_enabled() and _any_grad(updates, params):
        return None
    grads = tree_lib.leaves(updates)
    param_leaves = tree_lib.flatten(params)[0] if params is not None else [None] * len(grads)
    moments: dict[int, tuple[stored_adam.Stored, Any, Any]] = {}
    written: set[int] = set()
    for i, g in enumerate(grads):
        mu_codes, nu_codes = codes[0][i], codes[1][i]
        if mu_codes is None and nu_codes is None:
            continue
        if mu_codes is None or nu_codes is None or g is None:
            return None  # one moment stored and not the other, or a stored leaf without a gradient: read back
        entry = stored_adam.Stored(mu_codes, scales[0][i], nu_codes, scales[1][i], signed[0], signed[1], fmt.block_size, fmt.codec)
        if not stored_adam.takes(entry, g, param_leaves[i]):
            return None
        mu_placeholder, nu_placeholder = leaves[starts[0] + i], leaves[starts[1] + i]
        if id(mu_placeholder) in moments:
            return None  # one placeholder for two leaves: the step could not tell them apart
        moments[id(mu_placeholder)] = (entry, mu_placeholder, nu_placeholder)
        written.add(g.untyped_storage().data_ptr())
    params_read = dtensor_lib.storage_pointers(param_leaves)
    if not moments or len(written) != len(moments) or written & params_read:
        return None  # a gradient twice, or one sharing memory with a param: the order of the leaves would show
    with stored_adam.stored_moments(moments) as stepped:
        new_updates, new_inner = inner_update(updates, tree_lib.unflatten(state_def, leaves), params, inplace=inplace, **extra_args)
    new_leaves = check(new_inner)
    if set(stepped.results) != set(moments):
        raise RuntimeError("quantize_state: the Adam step left stored moments unstepped")
    new_codes = [list(c) for c in codes]
    new_scales = [list(s) for s in scales]
    for i in range(len(grads)):
        if codes[0][i] is None:
            continue
        mu_placeholder = leaves[starts[0] + i]
        mu_codes, mu_scales, nu_codes, nu_scales = stepped.results[id(mu_placeholder)]
        new_codes[0][i], new_scales[0][i], new_codes[1][i], new_scales[1][i] = mu_codes, mu_scales, nu_codes, nu_scales
        new_leaves[starts[0] + i], new_leaves[starts[1] + i] = mu_placeholder, leaves[starts[1] + i]
    return new_updates, new_leaves, new_codes, new_scales


def _any_grad(*trees: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad for tree in trees if tree is not None for x in tree_lib.leaves(tree))
