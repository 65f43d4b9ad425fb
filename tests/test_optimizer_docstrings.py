"""Every optimizer alias documents itself in optax's shape, and its example runs.

The aliases are found, not listed: every public function of ``gradtx.optimizers`` and
``gradtx.contrib`` except their ``scale_by_*`` transformations and the few named in NOT_ALIASES, so
an optimizer added later is checked without being named here. Each docstring has a one-line summary, a description, ``Args:`` naming every parameter of the
signature in order (and nothing else), ``Returns:``, ``References:`` with a linked paper and its
year, and ``Examples:`` that run as doctests and print what they show.

Also checked here, across the aliases: ``learning_rate=None`` is taken exactly where the signature
says so (and does what the docstring says) and is refused by name elsewhere, and every
``ScalarOrSchedule`` parameter, and every learning rate typed ``float`` as in optax, takes a 0-d
tensor as well as a number.
"""

from __future__ import annotations

import doctest
import inspect
import io
import re
import sys
import typing
import warnings

import pytest
import torch

import gradtx
import gradtx.optimizers
from gradtx import contrib

# The public functions of gradtx.optimizers' and gradtx.contrib's modules that are not optimizers,
# besides the scale_by_* transformations, and why. Every other one is an optimizer and is checked.
NOT_ALIASES = {
    "hutchinson_estimator_diag_hessian": "an estimator of the Hessian's diagonal, a transformation",
    "normalize": "a transformation (unit global norm)",
    "reduce_on_plateau": "a transformation that scales updates",
    "schedule_free_eval_params": "a function of a state and params",
    "split_real_and_imaginary": "a wrapper for complex parameters",
}

# Public functions elsewhere that take a learning rate, and why they are not optimizers.
TAKE_A_LEARNING_RATE = {
    "scale_by_learning_rate": "the scaling every optimizer ends with",
    "scale_by_madgrad": "MADGRAD's direction, a transformation",
    "scale_by_rprop": "Rprop's direction, a transformation",
}

OPTIMIZER_PACKAGES = ("gradtx.optimizers.", "gradtx.contrib.")


def public_functions() -> dict[str, typing.Any]:
    """Every function ``gradtx`` or ``gradtx.contrib`` exports (contrib's are also top-level)."""
    out = {}
    for module in (gradtx, contrib):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not inspect.isclass(obj) and not inspect.ismodule(obj):
                out[name] = obj
    return out


def discover_aliases() -> dict[str, typing.Any]:
    """The optimizers: the public functions defined in gradtx.optimizers or gradtx.contrib that are
    neither ``scale_by_*`` nor in NOT_ALIASES, keyed ``name`` or ``contrib.name`` by their package."""
    out = {}
    for name, fn in public_functions().items():
        module = getattr(fn, "__module__", "") or ""
        if module.startswith(OPTIMIZER_PACKAGES) and not name.startswith("scale_by_") and name not in NOT_ALIASES:
            out[f"contrib.{name}" if module.startswith("gradtx.contrib.") else name] = fn
    return out


ALIASES = discover_aliases()
NAMES = sorted(ALIASES)


def test_the_aliases_are_found_and_exported():
    # a sanity floor for the discovery above (optax's aliases and optax.contrib's optimizers)
    assert {"adam", "adamw", "sgd", "lbfgs", "dpsgd", "contrib.muon", "contrib.sam", "contrib.mechanize"} <= set(ALIASES)
    assert len(ALIASES) >= 52
    # every optimizer of gradtx.optimizers is exported there and at the top level
    assert {n for n in NAMES if not n.startswith("contrib.")} == set(gradtx.optimizers.__all__)
    for name, fn in ALIASES.items():
        assert getattr(gradtx, name.removeprefix("contrib."), None) is fn, f"{name} is not gradtx.{name}"
    assert set(NOT_ALIASES) <= set(public_functions()), "NOT_ALIASES names a function no longer exported"


def test_every_public_function_that_takes_a_learning_rate_is_an_optimizer():
    aliases = set(ALIASES.values())
    unknown = [
        name
        for name, fn in public_functions().items()
        if fn not in aliases
        and name not in TAKE_A_LEARNING_RATE
        and "learning_rate" in inspect.signature(fn).parameters
    ]
    assert not unknown, f"functions that take a learning rate but are not checked as optimizers: {unknown}"


SECTION_NAMES = ("Args", "Returns", "References", "Examples")


def sections(fn) -> dict[str, list[str]]:
    """The docstring's lines by section: "summary", "description", then each ``Name:`` section."""
    lines = inspect.cleandoc(fn.__doc__ or "").splitlines()
    found: dict[str, list[str]] = {"summary": lines[:1], "description": []}
    current = "description"
    for line in lines[1:]:
        heading = re.fullmatch(r"([A-Z]\w*):", line)
        if heading:
            current = heading.group(1)
            assert current not in found, f"{fn.__name__}: two {current}: sections"
            found[current] = []
        elif line and not line.startswith(" ") and current != "description":
            raise AssertionError(f"{fn.__name__}: unindented text in its {current}: section: {line!r}")
        else:
            found[current].append(line)
    return found


def documented_args(fn) -> list[str]:
    """The names the ``Args:`` section documents, in order (entries are ``  name: text``)."""
    return [m.group(1) for m in (re.match(r"  (\w+): \S", line) for line in sections(fn).get("Args", [])) if m]


def arg_text(fn, name: str) -> str:
    """The text of one ``Args:`` entry, its continuation lines joined."""
    lines = sections(fn)["Args"]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {name}: "))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"  \w+: ", lines[i])), len(lines))
    return " ".join(line.strip() for line in lines[start:end])


@pytest.mark.parametrize("name", NAMES)
def test_docstring_has_optax_sections(name):
    fn = ALIASES[name]
    found = sections(fn)
    summary = found["summary"][0] if found["summary"] else ""
    assert summary.endswith(".") and len(summary) <= 100, f"{name}: the first line is not a one-line summary: {summary!r}"
    description = found["description"]
    assert description and description[0] == "", f"{name}: no blank line after the summary"
    assert any(line.strip() for line in description), f"{name}: no description of the algorithm"
    missing = [s for s in SECTION_NAMES if not any(line.strip() for line in found.get(s, []))]
    assert not missing, f"{name}: missing or empty sections {missing}"
    references = " ".join(found["References"])
    assert re.search(r"<https?://\S+>`_", references), f"{name}: References give no link"
    assert re.search(r"\b(19|20)\d\d\b", references), f"{name}: References give no year"
    outside = [line for s, lines in found.items() if s != "Examples" for line in lines if ">>>" in line]
    assert not outside, f"{name}: doctest lines outside Examples: {outside}"


@pytest.mark.parametrize("name", NAMES)
def test_every_argument_is_documented_in_order(name):
    fn = ALIASES[name]
    parameters = [p.name for p in inspect.signature(fn).parameters.values()]
    assert documented_args(fn) == parameters


@pytest.mark.parametrize("name", NAMES)
def test_docstring_example_runs_and_prints_what_it_shows(name):
    fn = ALIASES[name]
    test = doctest.DocTestParser().get_doctest(
        fn.__doc__, {}, name, inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    )
    assert test.examples, f"{name}: no doctest example"
    assert any(example.want for example in test.examples), f"{name}: the example shows no output"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # optimistic_adam warns, as optax's does
        runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()


# --------------------------------------------------------------------------- learning_rate=None


def hints(fn) -> dict[str, typing.Any]:
    return typing.get_type_hints(fn)


def takes_none(fn, parameter: str) -> bool:
    return type(None) in typing.get_args(hints(fn).get(parameter))


def scalar_or_schedule_parameters(fn) -> list[str]:
    """The parameters typed ``ScalarOrSchedule`` (or ``Optional[ScalarOrSchedule]``)."""
    out = []
    for parameter, hint in hints(fn).items():
        options = [t for t in typing.get_args(hint) if t is not type(None)] if typing.get_origin(hint) is typing.Union else []
        if parameter != "return" and options == list(typing.get_args(gradtx.ScalarOrSchedule)):
            out.append(parameter)
    return out


WITH_RATE = [name for name in NAMES if "learning_rate" in inspect.signature(ALIASES[name]).parameters]
# learning rates typed ScalarOrSchedule; the others are typed ``float`` as in optax (no schedule)
SCHEDULED = {name for name in WITH_RATE if "learning_rate" in scalar_or_schedule_parameters(ALIASES[name])}
NUMBER_ONLY = sorted(set(WITH_RATE) - SCHEDULED)
# typed ``float`` as in optax, yet a schedule works when there is no warmup to build from it
SCHEDULED_WITHOUT_WARMUP = ["contrib.schedule_free_adamw", "contrib.schedule_free_sgd"]


def test_the_aliases_that_take_no_learning_rate_are_optax_s():
    names = [name for name in NAMES if takes_none(ALIASES[name], "learning_rate")]
    assert names == ["adadelta", "adafactor", "lbfgs"]


@pytest.mark.parametrize("name", [n for n in NAMES if takes_none(ALIASES[n], "learning_rate")])
def test_docstring_says_what_a_learning_rate_of_none_does(name):
    assert "``None``" in arg_text(ALIASES[name], "learning_rate")


# required arguments besides the learning rate
REQUIRED = {
    "dpsgd": dict(l2_norm_clip=1.0, noise_multiplier=0.0, seed=0),
    "contrib.schedule_free": dict(base_optimizer=gradtx.sgd(0.1)),
}


@pytest.mark.parametrize("name", [n for n in WITH_RATE if not takes_none(ALIASES[n], "learning_rate")])
def test_a_learning_rate_of_none_is_refused_by_name(name):
    fn = ALIASES[name]
    # the message lists what the signature takes: a schedule only where the hint is ScalarOrSchedule
    scheduled = name in SCHEDULED or name in SCHEDULED_WITHOUT_WARMUP
    takes = "a number, a 0-d tensor or a schedule" if scheduled else "a number or a 0-d tensor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: learning_rate must be {takes}, got None$"):
            fn(learning_rate=None, **REQUIRED.get(name, {}))


TARGET = {"w": torch.tensor([[1.0, -2.0], [0.5, 3.0]]), "b": torch.tensor([0.3, -0.7])}


def objective(params):
    return sum(((params[k] - TARGET[k]) ** 2).sum() for k in params)


def run(tx, steps: int = 3, *, per_example: bool = False) -> dict:
    """The params after ``steps`` steps of ``tx`` on ``objective`` from zeros."""
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    state = tx.init(params)
    for _ in range(steps):
        grads = torch.func.grad(objective)(params)
        if per_example:  # dpsgd takes a batch of per-example gradients
            grads = {k: torch.stack([g, 2 * g]) for k, g in grads.items()}
        extra = {}
        if isinstance(tx, gradtx.GradientTransformationExtraArgs):
            extra = dict(value=objective(params), grad=grads, value_fn=objective)
        updates, state = tx.update(grads, state, params, **extra)
        params = gradtx.apply_updates(params, updates)
    return params


def test_adadelta_without_a_learning_rate_returns_the_unscaled_direction_and_ascends():
    unscaled, descending = gradtx.adadelta(None, weight_decay=0.1), gradtx.adadelta(1.0, weight_decay=0.1)
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    grads = torch.func.grad(objective)(params)
    up, _ = unscaled.update(grads, unscaled.init(params), params)
    down, _ = descending.update(grads, descending.init(params), params)
    for k in params:
        assert torch.equal(up[k], -down[k])
    assert objective(gradtx.apply_updates(params, up)) > objective(params) > objective(gradtx.apply_updates(params, down))


def test_adafactor_without_a_learning_rate_takes_its_unit_step_and_descends():
    # optax's chain still ends in scale(-1): no learning rate is a learning rate of 1
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    expected = run(gradtx.adafactor(1.0, min_dim_size_to_factor=1))
    got = run(gradtx.adafactor(None, min_dim_size_to_factor=1))
    for k in expected:
        assert torch.equal(got[k], expected[k])
    assert objective(got) < objective(params)


def test_lbfgs_without_a_learning_rate_takes_its_unit_step_and_descends():
    # scale(-1) before the line search (or alone, without one): a learning rate of 1
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    for linesearch in ({}, {"linesearch": None}):
        expected = run(gradtx.lbfgs(1.0, **linesearch))
        got = run(gradtx.lbfgs(None, **linesearch))
        for k in expected:
            assert torch.equal(got[k], expected[k])
        assert objective(got) < objective(params)


# --------------------------------------------------------------------------- 0-d tensors


def test_scalar_or_schedule_is_one_type_that_takes_a_tensor():
    # every module that names the type in its signatures uses gradtx.numerics' one
    import gradtx.contrib.adam_variants  # noqa: F401 - imported for sys.modules
    import gradtx.contrib.madgrad  # noqa: F401
    import gradtx.contrib.schedule_free  # noqa: F401
    import gradtx.transforms.adam  # noqa: F401
    import gradtx.transforms.scaling  # noqa: F401
    import gradtx.transforms.weight_decay  # noqa: F401

    modules = [m for name, m in sorted(sys.modules.items()) if name.startswith("gradtx")]
    defined = {m.__name__: m.ScalarOrSchedule for m in modules if hasattr(m, "ScalarOrSchedule")}
    assert {"gradtx.transforms.scaling", "gradtx.transforms.weight_decay", "gradtx.contrib.madgrad"} <= set(defined)
    assert all(t is gradtx.ScalarOrSchedule for t in defined.values()), defined
    assert torch.Tensor in typing.get_args(gradtx.ScalarOrSchedule)


TYPED_CASES = [(name, p) for name in NAMES for p in scalar_or_schedule_parameters(ALIASES[name])]
# the learning rates typed ``float`` are documented to take a 0-d tensor as well
TENSOR_CASES = TYPED_CASES + [(name, "learning_rate") for name in NUMBER_ONLY]


def test_every_alias_with_a_learning_rate_types_it_as_a_scalar_or_schedule():
    # as in optax, these take no schedule (schedule-free's two only without a warmup)
    assert NUMBER_ONLY == ["contrib.schedule_free_adamw", "contrib.schedule_free_sgd", "optimistic_adam", "rprop", "sm3"]


@pytest.mark.parametrize("name", NUMBER_ONLY)
def test_a_schedule_where_a_number_is_needed_is_refused_by_name(name):
    fn = ALIASES[name]
    extra = {"warmup_steps": 2} if name in SCHEDULED_WITHOUT_WARMUP else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: learning_rate must be a number or a 0-d tensor.*got a schedule"):
            fn(learning_rate=lambda count: 0.1, **extra)


@pytest.mark.parametrize("name", SCHEDULED_WITHOUT_WARMUP)
def test_schedule_free_without_a_warmup_reads_a_schedule_at_t_and_t_minus_1(name):
    # what the docstring says: the averaging weights read it at t (from 1), the base optimizer at t - 1
    seen = []

    def constant(count):
        seen.append(int(count))
        return 0.1

    got = run(ALIASES[name](learning_rate=constant), steps=3)
    assert seen == [1, 0, 2, 1, 3, 2]
    expected = run(ALIASES[name](learning_rate=0.1), steps=3)
    for k in expected:
        assert torch.equal(got[k], expected[k])


@pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("name", "parameter"), TENSOR_CASES, ids=[f"{n}-{p}" for n, p in TENSOR_CASES])
def test_a_scalar_or_schedule_parameter_or_number_learning_rate_takes_a_0d_tensor(name, parameter):
    fn = ALIASES[name]
    default = inspect.signature(fn).parameters[parameter].default
    value = 0.1 if default in (inspect.Parameter.empty, None) or callable(default) or default == 0 else float(default)
    kwargs = dict(REQUIRED.get(name, {}))
    if "learning_rate" in inspect.signature(fn).parameters:
        kwargs.setdefault("learning_rate", 0.1)
    per_example = name == "dpsgd"
    expected = run(fn(**{**kwargs, parameter: value}), per_example=per_example)
    got = run(fn(**{**kwargs, parameter: torch.tensor(value)}), per_example=per_example)
    for k in expected:  # the tensor is float32, the number a Python float: the last bits may differ
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
