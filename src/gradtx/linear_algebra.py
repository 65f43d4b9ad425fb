"""Matrix helpers that optax exports at its top level: the dominant eigenpair by power iteration,
and the inverse p-th root of a PSD matrix (the preconditioner of Shampoo-style optimizers).

They are a module of their own, apart from :mod:`gradtx.numerics` (safe scalar and per-tensor
operations) and :mod:`gradtx.tree_utils` (leafwise tree arithmetic), because they are iterative
linear-algebra solvers on whole matrices. Plain torch, eager: the loops stop early by testing
their error on the host, as optax's ``while_loop`` does on the device.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from gradtx import tree_utils

PyTree = Any


def _generator(key: Union[torch.Generator, int, None], device: torch.device) -> torch.Generator:
    if isinstance(key, torch.Generator):
        return key
    if key is None:
        key = 0
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return torch.Generator(device=device).manual_seed(int(key))
    raise TypeError(f"power_iteration: key must be a torch.Generator or an integer seed, got a {type(key).__name__}")


def _normalize(tree: PyTree) -> PyTree:
    return tree_utils.tree_scale(1.0 / tree_utils.tree_norm(tree), tree)


def _square_matrix(fn: str, matrix: Any) -> Tensor:
    if not isinstance(matrix, Tensor):
        raise TypeError(f"{fn}: matrix must be a torch.Tensor (or, for power_iteration, a callable), got a {type(matrix).__name__}")
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{fn}: matrix must be square (n, n), got shape {tuple(matrix.shape)}")
    if not matrix.is_floating_point():
        raise TypeError(f"{fn}: matrix must be floating point, got {matrix.dtype}")
    return matrix


def power_iteration(
    matrix: Union[Tensor, Callable[[PyTree], PyTree]],
    *,
    v0: Optional[PyTree] = None,
    num_iters: int = 100,
    error_tolerance: float = 1e-6,
    key: Union[torch.Generator, int, None] = None,
) -> tuple[Tensor, PyTree]:
    """The dominant eigenvalue of a diagonalizable matrix, and its eigenvector (as optax's).

    Repeats ``v <- A v / |A v|`` until the residual ``|A v - lambda v| / |lambda|`` falls below
    ``error_tolerance`` or ``num_iters`` products are done; ``lambda = <v, A v>``.

    Args:
      matrix: an ``(n, n)`` tensor, or a callable computing the matrix-vector product of a pytree
        (then ``v0``, a pytree of that structure, is required).
      v0: the starting vector; for a tensor ``matrix`` it defaults to uniform draws in ``[-1, 1]``.
      num_iters: the most matrix-vector products after the first.
      error_tolerance: the relative residual at which to stop.
      key: a ``torch.Generator`` or an integer seed for the default ``v0`` (``None``: seed 0, as
        optax's ``PRNGKey(0)``). optax's ``precision`` argument has no torch counterpart: the
        products run in the matrix's dtype.

    Returns:
      ``(eigenvalue, eigenvector)``: a 0-d tensor and a unit-norm vector (pytree).

    ```python
    eigenvalue, eigenvector = gradtx.power_iteration(torch.diag(torch.tensor([3.0, 1.0])))
    ```
    """
    if callable(matrix) and not isinstance(matrix, Tensor):
        mvp = matrix
        if v0 is None:
            raise ValueError("power_iteration: v0 must be given when matrix is a callable")
    else:
        matrix = _square_matrix("power_iteration", matrix)
        mvp = lambda v: matrix @ v  # noqa: E731
        if v0 is None:
            generator = _generator(key, matrix.device)
            v0 = torch.rand(matrix.shape[-1:], generator=generator, dtype=matrix.dtype, device=matrix.device)
            v0 = v0 * 2 - 1
        elif not isinstance(v0, Tensor) or v0.shape != matrix.shape[-1:]:
            shape = tuple(v0.shape) if isinstance(v0, Tensor) else type(v0).__name__
            raise ValueError(f"power_iteration: v0 must be a vector of shape {tuple(matrix.shape[-1:])}, got {shape}")
    if num_iters < 0:
        raise ValueError(f"power_iteration: num_iters must be >= 0, got {num_iters}")

    def converged(v: PyTree, z: PyTree, eig: Tensor) -> bool:
        residual = tree_utils.tree_norm(tree_utils.tree_sub(z, tree_utils.tree_scale(eig, v)))
        return bool(torch.abs(residual / eig) < error_tolerance)

    v = _normalize(v0)
    z = mvp(v)
    eig = tree_utils.tree_norm(z) * 0
    step = 0
    while step < num_iters and not converged(v, z, eig):
        v = _normalize(z)
        z = mvp(v)
        eig = tree_utils.tree_vdot(v, z)
        step += 1
    return eig, _normalize(z)


def matrix_inverse_pth_root(
    matrix: Tensor,
    p: int,
    num_iters: int = 100,
    ridge_epsilon: float = 1e-6,
    error_tolerance: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """``(matrix + ridge * I) ** (-1/p)`` for a symmetric PSD matrix, by coupled Newton iterations.

    As optax's (Higham, *Functions of Matrices*, eq. 7.18): the ridge is ``ridge_epsilon`` times
    the largest eigenvalue (by :func:`power_iteration`), the iteration stops when
    ``max|M - I| <= error_tolerance``, after ``num_iters``, or when the error grows by more than
    20%, in which case the previous iterate is returned.

    Two deliberate differences: the iterate is raised to the exact power ``p`` for every positive
    integer ``p`` (optax's unrolled powers cover 1, 2, 4 and 8, and round other ``p`` to the nearest
    of those), and it is computed in the matrix's dtype (optax builds ``-1/p`` and the identity in
    float32), so a float64 matrix gets a float64-accurate root. optax's ``precision`` has no torch
    counterpart.

    Returns:
      ``(root, error)``: the root, in the matrix's dtype, and the final ``max|M - I|`` (0-d).
    """
    matrix = _square_matrix("matrix_inverse_pth_root", matrix)
    if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1:
        raise ValueError(f"matrix_inverse_pth_root: p must be a positive integer, got {p!r}")
    p = int(p)
    n = matrix.shape[0]
    dtype, device = matrix.dtype, matrix.device
    alpha = -1.0 / p
    max_ev, _ = power_iteration(matrix, num_iters=100, error_tolerance=1e-6)
    ridge = ridge_epsilon * torch.clamp(max_ev, min=1e-16)
    if n == 1:
        return (matrix + ridge) ** alpha, torch.zeros((), dtype=dtype, device=device)
    identity = torch.eye(n, dtype=dtype, device=device)
    damped = matrix + ridge * identity
    z = (1 + p) / (2 * torch.linalg.norm(damped))
    mat_m = damped * z
    mat_h = identity * z ** (1.0 / p)
    old_mat_h = mat_h
    error = torch.max(torch.abs(mat_m - identity))
    run_step = True
    step = 0
    while step < num_iters and run_step and bool(error > error_tolerance):
        mat_m_i = (1 - alpha) * identity + alpha * mat_m
        new_mat_m = torch.linalg.matrix_power(mat_m_i, p) @ mat_m
        new_mat_h = mat_h @ mat_m_i
        new_error = torch.max(torch.abs(new_mat_m - identity))
        run_step = bool(new_error < error * 1.2)
        old_mat_h, mat_m, mat_h, error = mat_h, new_mat_m, new_mat_h, new_error
        step += 1
    error = torch.max(torch.abs(mat_m - identity))
    return (mat_h if run_step else old_mat_h).to(dtype), error


__all__ = ["matrix_inverse_pth_root", "power_iteration"]
