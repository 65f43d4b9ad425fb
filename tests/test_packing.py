"""Many small leaves packed into one tensor for a pure step (gradtx.packing): the numbers are the
unpacked step's bit for bit, the inputs are never written, the outputs share no memory with them,
and everything packing cannot take (large, strided, differently shaped, differentiable, DTensor)
takes the unpacked step as before."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx
from gradtx import packing
from gradtx import tree as tree_lib

N_SMALL = 32  # at least twice packing.PACK_MIN_TENSORS: packed, in packs of both mask values
assert N_SMALL >= 2 * packing.PACK_MIN_TENSORS


def _tree(seed: int, *, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Small 1-d and 2-d leaves (packed), a 0-d and an empty one, and leaves packing leaves alone:
    one above the size bound and one transposed (not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    tree = {f"bias{i}": torch.randn(3, generator=gen, dtype=dtype) for i in range(N_SMALL)}
    tree.update({f"norm{i}": torch.randn(2, 5, generator=gen, dtype=dtype) for i in range(N_SMALL)})
    tree["scalar"] = torch.randn((), generator=gen, dtype=dtype)
    tree["empty"] = torch.randn(0, 4, generator=gen, dtype=dtype)
    tree["big"] = torch.randn(packing.PACK_MAX_ELEMENTS + 7, generator=gen, dtype=dtype)
    tree["transposed"] = torch.randn(6, 4, generator=gen, dtype=dtype).t()
    return tree


MASK = {k: not k.startswith("norm") for k in _tree(0)}
OPTIMIZERS = {
    "adam": lambda: gtx.adam(1e-2),
    "adamw": lambda: gtx.adamw(1e-2, weight_decay=0.1),
    "adamw_masked": lambda: gtx.adamw(1e-2, weight_decay=0.1, mask=MASK),
    "adamw_bf16_mu": lambda: gtx.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.bfloat16),
    "nadamw": lambda: gtx.nadamw(1e-2, weight_decay=0.1),
    "lion": lambda: gtx.lion(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: gtx.sgd(1e-2, momentum=0.9),
    "sgd_nesterov": lambda: gtx.sgd(1e-2, momentum=0.9, nesterov=True),
    "amsgrad": lambda: gtx.amsgrad(1e-2),
    "adabelief": lambda: gtx.adabelief(1e-2),
    "adamax": lambda: gtx.adamax(1e-2),
    "radam": lambda: gtx.radam(1e-2),
    "rmsprop": lambda: gtx.rmsprop(1e-2),
    "rmsprop_centered_bias_corrected": lambda: gtx.chain(gtx.scale_by_stddev(bias_correction=True), gtx.scale(-1e-2)),
    "adagrad": lambda: gtx.adagrad(1e-2),
    "adadelta": lambda: gtx.adadelta(1.0),
    "yogi": lambda: gtx.yogi(1e-2),
    "adan": lambda: gtx.adan(1e-2),
}


def _run(tx, params, grads_list, *, inplace=False):
    """Params and state after a step per gradient tree."""
    state = tx.init(params)
    for grads in grads_list:
        grads = {k: v.clone() for k, v in grads.items()} if inplace else grads
        updates, state = tx.update(grads, state, params, inplace=inplace)
        params = gtx.apply_updates(params, updates, inplace=inplace)
    return params, state


def _unpacked(monkeypatch):
    monkeypatch.setattr(packing, "PACK_MIN_TENSORS", 10**9)


def _assert_bitwise(a, b):
    la, lb = tree_lib.leaves(a), tree_lib.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y) or (x.isnan() == y.isnan()).all(), (x, y)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_packed_pure_step_has_the_unpacked_steps_numbers_and_the_donated_ones(monkeypatch, name):
    params, grads = _tree(0), [_tree(1 + i) for i in range(3)]
    packed = _run(OPTIMIZERS[name](), params, grads)
    small = [t for path, t in zip(gtx.tree.paths(packed[1]), tree_lib.leaves(packed[1])) if "bias" in str(path)]
    assert len({t.untyped_storage().data_ptr() for t in small}) < len(small)  # packed: shared buffers
    donated = _run(OPTIMIZERS[name](), {k: v.clone() for k, v in params.items()}, grads, inplace=True)
    _unpacked(monkeypatch)
    unpacked = _run(OPTIMIZERS[name](), params, grads)
    _assert_bitwise(packed, unpacked)
    _assert_bitwise(packed, donated)


def test_the_small_leaves_share_one_buffer_per_output_and_the_others_are_left_alone():
    tx = gtx.adamw(1e-2, weight_decay=0.1)
    params, grads = _tree(0), _tree(1)
    updates, state = tx.update(grads, tx.init(params), params)
    new_params = gtx.apply_updates(params, updates)
    for tree in (updates, state[0].mu, state[0].nu, new_params):
        storages = {k: v.untyped_storage().data_ptr() for k, v in tree.items()}
        small = {storages[f"bias{i}"] for i in range(N_SMALL)} | {storages[f"norm{i}"] for i in range(N_SMALL)}
        assert len(small) == 1  # packed: views into one buffer
        assert storages["big"] not in small and storages["transposed"] not in small
        assert tree["transposed"].stride() == params["transposed"].stride()  # its own layout, unpacked
        assert tree["scalar"].shape == () and tree["empty"].shape == (0, 4)


def test_a_packed_step_writes_no_input_and_returns_no_input_memory():
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2, weight_decay=0.1))
    params, grads = _tree(0), _tree(1)
    state = tx.init(params)
    state = tx.update(grads, state, params)[1]  # a state with non-zero moments
    copies = [t.clone() for t in tree_lib.leaves((params, grads, state))]
    updates, new_state = tx.update(grads, state, params)
    new_params = gtx.apply_updates(params, updates)
    _assert_bitwise(tree_lib.leaves((params, grads, state)), copies)
    inputs = {t.untyped_storage().data_ptr() for t in tree_lib.leaves((params, grads, state)) if t.numel()}
    outputs = {t.untyped_storage().data_ptr() for t in tree_lib.leaves((updates, new_state, new_params)) if t.numel()}
    assert not inputs & outputs


def test_bfloat16_params_take_float32_updates_packed_with_one_rounding(monkeypatch):
    params = {k: v.to(torch.bfloat16) for k, v in _tree(0).items()}
    updates = {k: v * 1e-3 for k, v in _tree(1).items()}
    packed = gtx.apply_updates(params, updates)
    assert {v.dtype for v in packed.values()} == {torch.bfloat16}
    _unpacked(monkeypatch)
    _assert_bitwise(packed, gtx.apply_updates(params, updates))


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=60),
    decayed=st.lists(st.booleans(), min_size=60, max_size=60),
    seed=st.integers(0, 2**16),
)
def test_random_trees_of_small_leaves_get_the_unpacked_numbers(shapes, decayed, seed):
    gen = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(shape, generator=gen) for i, shape in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(2)]
    mask = {k: decayed[i] for i, k in enumerate(params)}
    got = _run(gtx.adamw(1e-2, weight_decay=0.1, mask=mask), params, grads)
    saved = packing.PACK_MIN_TENSORS
    packing.PACK_MIN_TENSORS = 10**9
    try:
        want = _run(gtx.adamw(1e-2, weight_decay=0.1, mask=mask), params, grads)
    finally:
        packing.PACK_MIN_TENSORS = saved
    _assert_bitwise(got, want)


def test_a_step_that_records_a_graph_is_not_packed_and_stays_differentiable():
    params = {k: v.requires_grad_() for k, v in _tree(0).items() if k != "empty"}
    grads = {k: v.detach() for k, v in _tree(1).items() if k != "empty"}
    tx = gtx.adamw(1e-2, weight_decay=0.1)
    updates, state = tx.update(grads, tx.init(params), params)
    new_params = gtx.apply_updates(params, updates)
    storages = {v.untyped_storage().data_ptr() for k, v in state[0].mu.items() if k.startswith("bias")}
    assert len(storages) == N_SMALL  # one tensor each: nothing packed
    loss = sum(p.sum() for p in new_params.values())
    loss.backward()
    assert all(p.grad is not None for p in params.values())


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_a_state_shaped_unlike_its_updates_is_refused_naming_the_leaf(monkeypatch, packed):
    """Packing compares shapes at every position and leaves a mismatch to the unpacked step, whose
    error names the leaf."""
    if not packed:
        _unpacked(monkeypatch)
    params = {f"p{i}": torch.zeros(4) for i in range(N_SMALL)}
    state = gtx.trace(0.9).init(params)
    state = state._replace(trace={**state.trace, "p7": torch.zeros(4, 1)})
    grads = {k: torch.ones(4) for k in params}
    with pytest.raises(ValueError, match=r"state.trace\['p7'\] has shape \(4, 1\)"):
        gtx.trace(0.9).update(grads, state, params)


def test_positions_alike_in_size_but_not_in_shape_are_not_packed():
    calls = []

    def fn(a, b):
        calls.append(len(a))
        return ([x + y for x, y in zip(a, b)],)

    a = [torch.ones(2, 3) for _ in range(N_SMALL)]
    b = [torch.ones(2, 3) for _ in range(N_SMALL - 1)] + [torch.ones(3, 2)]
    with pytest.raises(RuntimeError):  # (2, 3) + (3, 2): what the unpacked step says
        packing.map_packed(fn, [a, b], 1)
    assert calls == [N_SMALL]  # called once, on the tensors as they are
    (sums,) = packing.map_packed(fn, [a, a], 1)
    assert calls == [N_SMALL, 1] and all(torch.equal(s, torch.full((2, 3), 2.0)) for s in sums)


def test_a_packed_state_saves_loads_and_resumes_as_an_uninterrupted_run():
    """checkpoint.state_dict -> torch.save -> torch.load(weights_only=True) -> load_state_dict: the
    moments, views into one buffer, come back as they were, and the next step is the uninterrupted one's."""
    tx = gtx.adamw(1e-2, weight_decay=0.1)
    params, grads = _tree(0), [_tree(1 + i) for i in range(3)]
    whole = _run(tx, params, grads)
    middle, middle_state = _run(tx, params, grads[:2])
    buffer = io.BytesIO()
    torch.save(gtx.checkpoint.state_dict(middle_state, middle), buffer)
    assert buffer.tell() < 3 * 4 * sum(v.numel() for v in params.values()) + 200_000  # each moment saved once
    buffer.seek(0)
    loaded = gtx.checkpoint.load_state_dict(tx.init(_tree(7)), torch.load(buffer, weights_only=True), middle)
    _assert_bitwise(loaded, middle_state)
    updates, state = tx.update(grads[2], loaded, middle)
    _assert_bitwise((gtx.apply_updates(middle, updates), state), whole)


def test_a_step_that_is_not_elementwise_is_refused():
    lists = [[torch.ones(2) for _ in range(N_SMALL)]]
    with pytest.raises(RuntimeError, match="elementwise"):
        packing.map_packed(lambda xs: ([x.sum(0, keepdim=True) for x in xs],), lists, 1)


def test_the_fallbacks_of_the_native_flatten_and_unflatten_give_the_same_views(monkeypatch):
    from gradtx import torch_internals

    tensors = [torch.randn(shape) for shape in [(2, 3), (), (4,), (0, 2), (1, 1, 2)]]
    flat = torch_internals.flatten_dense_tensors(tensors)
    views = torch_internals.unflatten_dense_tensors(flat, tensors)
    monkeypatch.delattr(torch._C._nn, "flatten_dense_tensors")
    monkeypatch.delattr(torch._C._nn, "unflatten_dense_tensors")
    assert torch.equal(torch_internals.flatten_dense_tensors(tensors), flat)
    for a, b, t in zip(torch_internals.unflatten_dense_tensors(flat, tensors), views, tensors):
        assert a.shape == b.shape == t.shape and torch.equal(a, b) and a.data_ptr() == b.data_ptr()


def test_per_position_values_without_a_plain_equality_leave_the_step_unpacked():
    import numpy as np

    calls = []

    def fn(a, factors):
        calls.append(len(a))
        return ([x * float(f[0]) for x, f in zip(a, factors)],)

    a = [torch.ones(2) for _ in range(N_SMALL)]
    factors = [np.array([float(i), 0.0]) for i in range(N_SMALL)]  # == gives arrays, not bools
    (out,) = packing.map_packed(fn, [a, factors], 1)
    assert calls == [N_SMALL] and all(torch.equal(o, torch.full((2,), float(i))) for i, o in enumerate(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_new_leaf_starts_where_a_tensor_of_its_own_would(dtype):
    """At an ALIGNMENT-byte boundary: a kernel that takes another path for unaligned data (BLAS
    does) then rounds a packed leaf as it rounds a fresh one, so a step after it (GaLore projecting
    back, say) keeps the unpacked numbers too."""
    tx = gtx.adamw(1e-2, weight_decay=0.1)
    params, grads = _tree(0, dtype=dtype), _tree(1, dtype=dtype)
    params.update({f"odd{i}": torch.randn(i % 5 + 1, 3, dtype=dtype) for i in range(N_SMALL)})  # mixed shapes
    grads.update({k: torch.randn(v.shape, dtype=dtype) for k, v in params.items() if k.startswith("odd")})
    updates, state = tx.update(grads, tx.init(params), params)
    new_params = gtx.apply_updates(params, updates)
    for tree in (updates, state[0].mu, state[0].nu, new_params):
        for key, leaf in tree.items():
            if leaf.numel():
                assert leaf.data_ptr() % packing.ALIGNMENT == 0, key
    a = updates["odd3"].reshape(-1, 3)
    b = torch.randn(3, 5, dtype=dtype)
    assert torch.equal(a @ b, a.clone() @ b)
