"""power_iteration and matrix_inverse_pth_root against float64 eigendecompositions (torch.linalg.eigh)."""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx import linear_algebra

F64 = torch.float64


def spd(n: int, seed: int, floor: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=F64)
    return a @ a.T / n + floor * torch.eye(n, dtype=F64)


def test_exported_from_the_linear_algebra_module():
    assert gtx.power_iteration is linear_algebra.power_iteration
    assert gtx.matrix_inverse_pth_root is linear_algebra.matrix_inverse_pth_root


@pytest.mark.parametrize("n, seed", [(2, 0), (5, 1), (16, 2)])
def test_power_iteration_finds_the_dominant_eigenpair(n, seed):
    matrix = spd(n, seed)
    values, vectors = torch.linalg.eigh(matrix)
    eigenvalue, eigenvector = gtx.power_iteration(matrix, num_iters=5000, error_tolerance=1e-13)
    assert eigenvalue.dtype == F64 and eigenvalue.shape == ()
    torch.testing.assert_close(eigenvalue, values[-1], rtol=1e-10, atol=0)
    reference = vectors[:, -1] * torch.sign(vectors[:, -1] @ eigenvector)
    torch.testing.assert_close(eigenvector, reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.linalg.norm(eigenvector), torch.tensor(1.0, dtype=F64))


def test_power_iteration_with_a_matrix_vector_product_over_a_pytree():
    # A block-diagonal operator acting on {"x": R^2, "y": R^3}; its largest eigenvalue is 7 (on "y").
    a = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=F64)
    b = torch.diag(torch.tensor([7.0, 1.0, -3.0], dtype=F64))
    mvp = lambda v: {"x": a @ v["x"], "y": b @ v["y"]}  # noqa: E731
    v0 = {"x": torch.ones(2, dtype=F64), "y": torch.ones(3, dtype=F64)}
    eigenvalue, eigenvector = gtx.power_iteration(mvp, v0=v0, num_iters=1000, error_tolerance=1e-12)
    torch.testing.assert_close(eigenvalue, torch.tensor(7.0, dtype=F64), rtol=1e-10, atol=0)
    torch.testing.assert_close(eigenvector["y"], torch.tensor([1.0, 0.0, 0.0], dtype=F64), rtol=0, atol=1e-8)
    torch.testing.assert_close(eigenvector["x"], torch.zeros(2, dtype=F64), rtol=0, atol=1e-8)


def test_power_iteration_negative_dominant_eigenvalue_and_keys():
    matrix = torch.diag(torch.tensor([-5.0, 2.0, 1.0], dtype=F64))
    eigenvalue, _ = gtx.power_iteration(matrix, num_iters=2000, error_tolerance=1e-12, key=3)
    torch.testing.assert_close(eigenvalue, torch.tensor(-5.0, dtype=F64), rtol=1e-10, atol=0)
    first = gtx.power_iteration(matrix, num_iters=2)
    again = gtx.power_iteration(matrix, num_iters=2, key=torch.Generator().manual_seed(0))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])  # key None is seed 0
    zero_iters, _ = gtx.power_iteration(matrix, num_iters=0)
    assert float(zero_iters) == 0.0  # no product after the first: the estimate is still 0, as optax's


def test_power_iteration_errors():
    with pytest.raises(ValueError, match="v0 must be given"):
        gtx.power_iteration(lambda v: v)
    with pytest.raises(ValueError, match=r"square \(n, n\), got shape \(2, 3\)"):
        gtx.power_iteration(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"v0 must be a vector of shape \(3,\), got \(2,\)"):
        gtx.power_iteration(torch.eye(3), v0=torch.ones(2))
    with pytest.raises(TypeError, match="key must be"):
        gtx.power_iteration(torch.eye(3), key="seed")
    with pytest.raises(TypeError, match="floating point"):
        gtx.power_iteration(torch.eye(3, dtype=torch.int64))


def reference_root(matrix: torch.Tensor, p: int, ridge_epsilon: float) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(matrix)
    ridge = ridge_epsilon * values[-1]
    return vectors @ torch.diag((values + ridge) ** (-1.0 / p)) @ vectors.T


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("n, seed", [(3, 0), (8, 1)])
def test_matrix_inverse_pth_root_against_eigh(p, n, seed):
    matrix = spd(n, seed)
    root, error = gtx.matrix_inverse_pth_root(matrix, p, error_tolerance=1e-13, num_iters=200)
    assert root.dtype == F64 and root.shape == (n, n)
    assert float(error) < 1e-10
    torch.testing.assert_close(root, reference_root(matrix, p, 1e-6), rtol=1e-9, atol=1e-11)
    # the defining property: root^p (matrix + ridge) = I
    power = torch.linalg.matrix_power(root, p)
    ridge = 1e-6 * torch.linalg.eigvalsh(matrix)[-1]
    torch.testing.assert_close(power @ (matrix + ridge * torch.eye(n, dtype=F64)), torch.eye(n, dtype=F64), rtol=0, atol=1e-9)


def test_matrix_inverse_pth_root_ridge_makes_a_singular_matrix_invertible():
    v = torch.tensor([[1.0], [2.0], [2.0]], dtype=F64)
    singular = v @ v.T  # rank one, eigenvalues 9, 0, 0
    root, _ = gtx.matrix_inverse_pth_root(singular, 2, ridge_epsilon=1e-2, error_tolerance=1e-13, num_iters=500)
    torch.testing.assert_close(root, reference_root(singular, 2, 1e-2), rtol=1e-8, atol=1e-10)


def test_matrix_inverse_pth_root_one_by_one_and_float32():
    root, error = gtx.matrix_inverse_pth_root(torch.tensor([[4.0]], dtype=F64), 2, ridge_epsilon=0.0)
    torch.testing.assert_close(root, torch.tensor([[0.5]], dtype=F64))
    assert float(error) == 0.0
    matrix = spd(6, 3).float()
    root32, _ = gtx.matrix_inverse_pth_root(matrix, 4)
    assert root32.dtype == torch.float32
    torch.testing.assert_close(root32.double(), reference_root(matrix.double(), 4, 1e-6), rtol=1e-4, atol=1e-5)


def test_matrix_inverse_pth_root_errors():
    for p in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="p must be a positive integer"):
            gtx.matrix_inverse_pth_root(torch.eye(2, dtype=F64), p)
    with pytest.raises(ValueError, match="square"):
        gtx.matrix_inverse_pth_root(torch.ones(3, dtype=F64), 2)
