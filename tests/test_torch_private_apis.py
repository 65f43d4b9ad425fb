"""The private torch APIs gradtx relies on: each exists in the running torch (a torch release that
drops or renames one fails here, by name), the inventory names every one the code reaches by module
path, and each fallback gives the same results as the private API where torch lacks it."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import Parameter

import gradtx as gtx
from gradtx import buffer_pool, compiled_step, torch_internals
from gradtx import tree as tree_lib
from gradtx.interop import torch_kernels
wrap_module = importlib.import_module("gradtx.interop.wrap")

SRC = Path(gtx.__file__).resolve().parent


def _instance(owner: str):
    """An instance of ``owner`` (a ``Class()`` entry of the inventory) whose attributes are checked."""
    if owner == "torch.optim.Optimizer":
        return torch.optim.SGD([Parameter(torch.zeros(2))], lr=0.1)
    raise AssertionError(f"no instance known for {owner}")


def _resolve(path: str) -> object:
    """The object at ``module.attribute`` ``path`` (``Class().attr`` reads an instance's attribute)."""
    owner_path, _, instance_rest = path.partition("().")
    parts = owner_path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        break
    if instance_rest:
        value = _instance(owner_path)
        for attribute in instance_rest.split("."):
            value = getattr(value, attribute)
    return value


@pytest.mark.parametrize("entry", torch_internals.PRIVATE_APIS)
def test_every_private_api_exists_in_this_torch(entry):
    errors = []
    for path in entry.split(" | "):
        try:
            _resolve(path)
            return
        except AttributeError as error:
            errors.append(f"{path}: {error}")
    pytest.fail(f"torch {torch.__version__} lacks {entry}: " + "; ".join(errors))


def _inventory_prefixes() -> set[str]:
    names = set()
    for entry in torch_internals.PRIVATE_APIS:
        for path in entry.split(" | "):
            parts = path.replace("()", "").split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


def _dotted(node: ast.AST):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _torch_paths_in_source():
    """``(file, torch path)`` for each ``torch.x._y`` attribute chain and ``from torch.x import _y``."""
    for file in sorted(SRC.rglob("*.py")):
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
                path = _dotted(node)
                if path is not None and path.startswith("torch."):
                    yield file.relative_to(SRC), path
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                for alias in node.names:
                    yield file.relative_to(SRC), f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch"):
                        yield file.relative_to(SRC), alias.name
            for child in ast.iter_child_nodes(node):
                child.parent = node  # type: ignore[attr-defined]


def test_the_inventory_names_every_private_torch_path_the_code_uses():
    known = _inventory_prefixes()
    unlisted = sorted({f"{file}: {path}" for file, path in _torch_paths_in_source() if _private(path) and path not in known})
    assert not unlisted, "private torch APIs missing from torch_internals.PRIVATE_APIS:\n" + "\n".join(unlisted)


_FOREACH_CALLERS = {"foreach": 0, "foreach_kernel": 0, "_elementwise": 0, "_clamp_side": 0, "_binary": 1}


def test_the_inventory_names_every_foreach_kernel_the_code_calls():
    called = set()
    for file in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            position = _FOREACH_CALLERS.get(name)
            if position is None or len(node.args) <= position:
                continue
            arg = node.args[position]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                # tree.foreach and the helpers over it run the in-place kernel too
                called.update({arg.value} if name == "foreach_kernel" else {arg.value, f"{arg.value}_"})
    assert called, "found no foreach calls: the scan is broken"
    assert called <= set(torch_internals.FOREACH_KERNELS), sorted(called - set(torch_internals.FOREACH_KERNELS))


# --------------------------------------------------------------------------- fallbacks


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in ((3,), (2, 4), (5,))]


@pytest.mark.parametrize(
    "name,args,kwargs",
    [
        ("add", ("others",), {"alpha": 0.5}),
        ("addcmul", ("others", "others"), {"value": 0.25}),
        ("lerp", ("others", 0.3), {}),
        ("maximum", ("others",), {}),
        ("mul", ([0.5, 2.0, -1.0],), {}),
        ("sqrt", (), {}),
        ("clamp_min", (0.1,), {}),
        ("sub", ("others",), {}),
        ("pow", (2.0,), {}),
    ],
)
@pytest.mark.parametrize("inplace", [False, True])
def test_a_foreach_kernel_torch_lacks_runs_tensor_by_tensor(monkeypatch, name, args, kwargs, inplace):
    selves, others = _tensors(), [t.flip(0) + 1 for t in _tensors()]
    if name in ("sqrt", "pow"):
        selves = [t.abs() for t in selves]
    resolved = tuple(others if a == "others" else a for a in args)
    kernel = f"{name}_" if inplace else name
    expected = [t.clone() for t in selves]
    native = getattr(torch, f"_foreach_{kernel}")(expected, *resolved, **kwargs)
    expected = expected if inplace else native
    monkeypatch.delattr(torch, f"_foreach_{kernel}")
    got = [t.clone() for t in selves]
    result = torch_internals.foreach_kernel(kernel)(got, *resolved, **kwargs)
    if inplace:
        assert result is None
    else:
        got = result
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_foreach_norm_zero_and_copy_run_tensor_by_tensor_without_their_kernels(monkeypatch):
    tensors = _tensors()
    expected = torch._foreach_norm(tensors, 3.0, dtype=torch.float64)
    for name in ("norm", "zero_", "copy_"):
        monkeypatch.delattr(torch, f"_foreach_{name}")
    norms = torch_internals.foreach_kernel("norm")(tensors, 3.0, dtype=torch.float64)
    for n, e in zip(norms, expected):
        torch.testing.assert_close(n, e, rtol=1e-15, atol=0)
    buffers = [torch.empty_like(t) for t in tensors]
    torch_internals.foreach_kernel("copy_")(buffers, tensors)
    assert all(torch.equal(b, t) for b, t in zip(buffers, tensors))
    torch_internals.foreach_kernel("zero_")(buffers)
    assert all(not b.any() for b in buffers)


def test_an_optimizer_step_without_foreach_kernels_has_the_same_numbers(monkeypatch):
    """Every foreach kernel gone: adamw with a clip runs tensor by tensor, to the same numbers."""
    params = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), "b": torch.ones(3)}
    grads = {"w": torch.full((4, 3), 0.5), "b": torch.arange(3.0)}
    tx = gtx.chain(gtx.clip_by_global_norm(0.7), gtx.adamw(0.1, weight_decay=0.01))

    def run():
        state = tx.init(params)
        p = params
        for _ in range(3):
            updates, state = tx.update(grads, state, p)
            p = gtx.apply_updates(p, updates)
        return p

    expected = run()
    for name in torch_internals.FOREACH_KERNELS:
        monkeypatch.delattr(torch, f"_foreach_{name}")
    got = run()
    for key in params:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)


def _mixed():
    return [torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(1), torch.zeros(2, dtype=torch.float16)]


def test_grouping_without_torchs_cpp_grouping_gives_the_same_groups(monkeypatch):
    tensors = _mixed()
    expected = [indices for indices, _ in tree_lib.grouped(tensors)]
    expected_clip = tree_lib.torch_groups(tensors)
    monkeypatch.delattr(torch._C, "_group_tensors_by_device_and_dtype")
    monkeypatch.delattr(sys.modules["torch.utils._foreach_utils"], "_group_tensors_by_device_and_dtype")
    assert [indices for indices, _ in tree_lib.grouped(tensors)] == expected == [[0, 2], [1], [3]]
    assert sorted(tree_lib.torch_groups(tensors)) == sorted(expected_clip)


def test_clip_by_global_norm_without_torchs_grouping_has_torchs_norm(monkeypatch):
    grads = [torch.arange(3.0), torch.ones(2, dtype=torch.float64), torch.full((2,), 2.0)]
    reference = [Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(reference, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    reference = [p.grad for p in reference]
    monkeypatch.delattr(torch._C, "_group_tensors_by_device_and_dtype")
    monkeypatch.delattr(sys.modules["torch.utils._foreach_utils"], "_group_tensors_by_device_and_dtype")
    tx = gtx.clip_by_global_norm(1.0)
    clipped, _ = tx.update(grads, tx.init(grads))
    assert torch.equal(tree_lib.total_norm(grads, 2.0), expected)
    for c, r in zip(clipped, reference):
        torch.testing.assert_close(c, r, rtol=0, atol=0)


def _drop_functorch(monkeypatch, *names):
    for name in names:
        monkeypatch.delattr(torch._C._functorch, name)


def test_without_functorch_level_every_tensor_is_checked_for_wrappers(monkeypatch):
    _drop_functorch(monkeypatch, "maybe_current_level")
    assert torch_internals.functorch_active()
    assert not tree_lib.needs_graph([torch.zeros(2)])  # a plain tensor outside transforms: fast path


def test_without_the_wrapper_test_under_torch_func_the_differentiable_path_is_taken(monkeypatch):
    _drop_functorch(monkeypatch, "is_functorch_wrapped_tensor")
    assert tree_lib.needs_graph([torch.zeros(2)]) is torch_internals.functorch_active()
    tx = gtx.adam(0.1)
    params = torch.tensor([1.0, -2.0])

    def loss(p):
        updates, _ = tx.update(p * 2.0, tx.init(p), p)
        return (p + updates).square().sum()

    expected = torch.func.grad(lambda p: (p - 0.1 * torch.sign(p)).square().sum())(params)
    torch.testing.assert_close(torch.func.grad(loss)(params), expected, rtol=1e-5, atol=1e-6)


def test_functorch_unwrapped_without_the_api(monkeypatch):
    key = torch.arange(4, dtype=torch.uint8)
    _drop_functorch(monkeypatch, "get_unwrapped")
    assert torch_internals.functorch_unwrapped(key, owner="x") is key
    with pytest.raises(RuntimeError, match="x: under a torch.func transform.*get_unwrapped"):
        torch.func.grad(lambda p: torch_internals.functorch_unwrapped(p, owner="x").sum())(torch.ones(2))


def test_hutchinson_outside_transforms_needs_no_functorch_internals(monkeypatch):
    params = {"w": torch.tensor([1.0, 2.0, 3.0])}

    def estimate():
        tx = gtx.hutchinson_estimator_diag_hessian(random_seed=3)
        out, _ = tx.update(params, tx.init(params), params, obj_fn=lambda p: (p["w"] ** 3).sum())
        return out["w"]

    expected = estimate()
    _drop_functorch(monkeypatch, "get_unwrapped", "is_functorch_wrapped_tensor")
    torch.testing.assert_close(estimate(), expected, rtol=0, atol=0)
    torch.testing.assert_close(expected, 6.0 * params["w"], rtol=0, atol=0)  # z * (H z) = diag(H) for z = +-1


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_fused", [None, False, True])
def test_optimizer_scalar_dtype_without_torchs_helper(monkeypatch, default, is_fused):
    from torch.optim import optimizer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        expected = optimizer._get_scalar_dtype(is_fused=is_fused)
        monkeypatch.delattr(optimizer, "_get_scalar_dtype")
        assert torch_internals.optimizer_scalar_dtype(is_fused) == expected
    finally:
        torch.set_default_dtype(previous)


def test_from_torch_adam_without_torchs_scalar_dtype_helper(monkeypatch):
    from torch.optim import optimizer

    param = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    reference = torch.optim.Adam([param])
    param.grad = torch.ones(2)
    reference.step()
    expected = reference.state[param]["step"]
    monkeypatch.delattr(optimizer, "_get_scalar_dtype")
    slots = torch_kernels.KERNELS[torch.optim.Adam].init(param, {"capturable": False, "fused": False, "amsgrad": False})
    assert (slots["step"].dtype, slots["step"].device) == (expected.dtype, expected.device)


def test_the_pool_without_storage_counts_pools_nothing(monkeypatch):
    """(``tests/test_buffer_pool.py`` checks that an unreadable count means fresh buffers every call.)"""
    template = torch.zeros(buffer_pool.RECYCLE_MIN_BYTES // 4)
    assert buffer_pool._counts_readable() and buffer_pool.recyclable(template)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert not buffer_pool._counts_readable()
    monkeypatch.setattr(buffer_pool, "_COUNTS_READABLE", buffer_pool._counts_readable())
    assert not buffer_pool.recyclable(template)
    buffer = buffer_pool.BufferPool().take([template])[0]
    assert (buffer.shape, buffer.stride(), buffer.dtype) == (template.shape, template.stride(), template.dtype)


def _wrapped_sgd():
    param = Parameter(torch.tensor([1.0, 2.0]))
    optimizer = gtx.wrap(torch.optim.SGD([param], lr=0.5), gtx.scale(2.0))
    param.grad = torch.tensor([1.0, -1.0])
    return param, optimizer


def _record_hooks(calls):
    optimizer_module = importlib.import_module("torch.optim.optimizer")
    pre = optimizer_module.register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", type(opt).__name__)))
    post = optimizer_module.register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append(("post", type(opt).__name__)))
    return pre, post


@pytest.mark.parametrize("step_code", [True, False])
def test_wrap_runs_torchs_global_step_hooks_once_with_the_wrapper(monkeypatch, step_code):
    """(With or without ``Optimizer._optimizer_step_code``, a no-op profilers look for.)"""
    if not step_code:
        monkeypatch.delattr(torch.optim.Optimizer, "_optimizer_step_code")
    calls: list = []
    handles = _record_hooks(calls)
    try:
        param, optimizer = _wrapped_sgd()
        optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [("pre", "ChainedOptimizer"), ("post", "ChainedOptimizer")]
    assert torch.equal(param.detach(), torch.tensor([0.0, 3.0]))


def test_wrap_where_torch_keeps_global_hooks_elsewhere_lets_torchs_step_run_them(monkeypatch):
    """Without the module-level hook dicts, the inner optimizer's hooked step runs the hooks, once."""
    calls: list = []
    handles = _record_hooks(calls)
    monkeypatch.setattr(wrap_module, "torch_optimizer", object())  # a torch.optim.optimizer without them
    try:
        param, optimizer = _wrapped_sgd()
        optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [("pre", "SGD"), ("post", "SGD")]
    assert torch.equal(param.detach(), torch.tensor([0.0, 3.0]))


def test_wrap_where_torch_keeps_an_optimizers_hooks_elsewhere_lets_its_step_run_them(monkeypatch):
    calls: list = []
    param, optimizer = _wrapped_sgd()
    optimizer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("inner pre"))
    optimizer.optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("inner post"))
    assert optimizer._raw_inner_step() is not None
    monkeypatch.setattr(wrap_module, "_INNER_STEP_HOOKS", ("_renamed_pre_hooks", "_renamed_post_hooks"))
    assert optimizer._raw_inner_step() is None
    optimizer.step()
    assert calls == ["inner pre", "inner post"]
    assert torch.equal(param.detach(), torch.tensor([0.0, 3.0]))


def test_wrap_keeps_every_hook_dict_torchs_optimizer_init_makes():
    """The wrapper skips ``Optimizer.__init__``: it must make each hook dict that ``__init__`` makes."""
    made = {name for name in _instance("torch.optim.Optimizer").__dict__ if name.startswith("_optimizer_") and name.endswith("_hooks")}
    assert made == set(wrap_module._HOOK_DICTS)


def test_dynamo_settings_under_their_names_before_torch_2_7(monkeypatch):
    config = importlib.import_module("torch._dynamo.config")
    name, value = compiled_step._dynamo_setting("recompile_limit", "cache_size_limit")
    assert value == getattr(config, name.rsplit(".", 1)[1])

    class OldConfig:
        cache_size_limit = 8
        accumulated_cache_size_limit = 256

    monkeypatch.setattr(torch._dynamo, "config", OldConfig)
    assert compiled_step._dynamo_setting("recompile_limit", "cache_size_limit") == ("torch._dynamo.config.cache_size_limit", 8)
    assert compiled_step._dynamo_setting("accumulated_recompile_limit", "accumulated_cache_size_limit") == (
        "torch._dynamo.config.accumulated_cache_size_limit",
        256,
    )
    monkeypatch.setattr(torch._dynamo, "config", object())
    assert compiled_step._dynamo_setting("recompile_limit", "cache_size_limit") == ("torch._dynamo.config.recompile_limit", None)


def test_compile_step_variants_without_dynamos_cache_listing(monkeypatch):
    importlib.import_module("torch._dynamo.eval_frame")
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    assert compiled_step._variants((lambda: None).__code__) is None


def test_recompile_limit_errors_recognised_under_either_name(monkeypatch):
    exc = importlib.import_module("torch._dynamo.exc")
    kinds = [getattr(exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, n)]
    assert kinds and all(compiled_step._is_recompile_limit_hit(kind("hit")) for kind in kinds)
    for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit"):
        monkeypatch.delattr(exc, name, raising=False)
    assert not compiled_step._is_recompile_limit_hit(kinds[0]("hit"))
    assert not compiled_step._is_recompile_limit_hit(RuntimeError("hit"))


def test_traced_failures_recognised_and_without_dynamos_base_class_none_is(monkeypatch):
    exc = importlib.import_module("torch._dynamo.exc")
    assert compiled_step._is_traced_failure(exc.TorchRuntimeError("traced")) and not compiled_step._is_traced_failure(ValueError("eager"))
    monkeypatch.delattr(exc, "TorchDynamoException")
    assert not compiled_step._is_traced_failure(exc.TorchRuntimeError("traced"))  # the tracer's error stands


@pytest.mark.parametrize("unchecked", [True, False], ids=["aten-unsafe-index", "without-it"])
def test_the_quantization_table_lookup_while_compiling_with_and_without_the_unchecked_index(monkeypatch, unchecked):
    from gradtx.quantization import kernels

    table = torch.linspace(-1.0, 1.0, 256)
    index = torch.randint(0, 256, (3, 5, 7), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    if not unchecked:
        monkeypatch.setattr(torch_internals, "unchecked_index", None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the branch a compiled loop traces
    looked_up = kernels.gather(table, index)
    monkeypatch.undo()
    assert torch.equal(looked_up, table[index.long()]) and torch.equal(looked_up, kernels.gather(table, index))


def test_compile_step_without_inductors_choices_hook_compiles_with_its_own_choices(monkeypatch):
    """Where torch lacks ``V.set_choices_handler``, compile_step passes no choices and compiles as is."""
    from gradtx import compiled_fusion
    from torch._inductor.virtualized import V

    compiled_fusion._choices_class.cache_clear()
    monkeypatch.delattr(type(V), "set_choices_handler")
    try:
        assert compiled_fusion._choices_class() is None
        assert compiled_fusion.cache_options() == {}
        with compiled_fusion.fusing_reductions():
            pass
        tx = gtx.sgd(0.1)
        step = gtx.compile_step(tx, backend="eager")
        params = {"w": torch.ones(3)}
        new, _ = step({"w": torch.ones(3)}, tx.init(params), params)
        assert torch.equal(new["w"], torch.full((3,), 0.9))
    finally:
        monkeypatch.undo()
        compiled_fusion._choices_class.cache_clear()
    assert compiled_fusion._choices_class() is not None


def test_group_counts_are_left_alone_where_torch_keeps_none(monkeypatch):
    """Where torch's process-group state has no ``group_count``, the ranks have no count to agree
    on: no collective runs (the distributed case ``groups_over_several_axes_whatever_groups_ranks_made_before``
    checks the agreement itself)."""
    import torch.distributed as dist

    from gradtx.sharding import mesh as mesh_lib

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist.distributed_c10d, "_world", object())
    mesh_lib._agree_on_group_count(torch.device("cpu"))
    monkeypatch.delattr(dist.distributed_c10d, "_world")
    mesh_lib._agree_on_group_count(torch.device("cpu"))
