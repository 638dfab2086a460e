"""Walsh–Hadamard transforms in torch: O(n log n), CPU or GPU, no CUDA-only package.

HIGGS rotates each group of channels by a Hadamard matrix so that what it quantizes looks Gaussian.
``fwht`` is the fast transform for power-of-two sizes (the Sylvester matrix, unnormalized). KV groups
are not always a power of two — SmolLM2 has 3 KV heads × 64 = 192 channels — so ``hadamard_transform``
also handles ``n = m · 2^k`` with ``m`` ∈ {12, 20}: the Kronecker product of a Paley matrix of order
``m`` (dense, tiny) with the Sylvester matrix of order ``2^k`` (fast). Other sizes must be padded
(``supported_size`` says to what).

``hadamard_transform`` applies sizes up to ``DENSE_MAX`` = 256 as one matmul with the cached ±1 matrix
(on a CPU that beats the butterfly's log2(n) passes of small copies: HIGGS dequantizes the whole history
every decode step) and larger ones with the O(n log n) path; both give the same matrix (tested).

Pure torch: this module imports with torch alone.
"""

from __future__ import annotations

from functools import cache

import torch

from kvquant.quant.device import on_device

PALEY_ORDERS = (12, 20)
DENSE_MAX = 256  # up to this size a transform is one dense matmul (±1 entries: exact in fp32); beyond, O(n log n)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh–Hadamard transform along the last dim (``x @ H_n``, Sylvester order).

    ``H_n`` is symmetric with ``H_n @ H_n = n·I``, so applying ``fwht`` twice multiplies by ``n``.
    """
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"fwht needs a power-of-two size, got {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return y.view(*lead, n)


def sylvester(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``n×n`` Sylvester–Hadamard matrix (for tests and tiny sizes)."""
    if not is_power_of_two(n):
        raise ValueError(f"Sylvester matrices exist for powers of two only, got {n}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@cache
def paley(m: int) -> torch.Tensor:
    """Hadamard matrix of order ``m = q + 1`` for a prime ``q ≡ 3 (mod 4)`` (Paley construction I)."""
    q = m - 1
    if m not in PALEY_ORDERS:
        raise ValueError(f"Paley orders available: {PALEY_ORDERS}, got {m}")
    residues = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if a in residues else -1 for a in range(1, q)]
    jacobsthal = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float32)
    s = torch.zeros(m, m)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jacobsthal
    return torch.eye(m) + s


def factor(n: int) -> tuple[int, int] | None:
    """``(m, 2^k)`` with ``n = m · 2^k`` and ``m`` ∈ {1, 12, 20}, or None if no Hadamard transform here fits."""
    if is_power_of_two(n):
        return 1, n
    for m in PALEY_ORDERS:
        if n % m == 0 and is_power_of_two(n // m):
            return m, n // m
    return None


def supported_size(n: int) -> int:
    """The smallest size ``>= n`` that ``hadamard_transform`` handles (pad to it)."""
    size = n
    while factor(size) is None:
        size += 1
    return size


@cache
def _hadamard_cached(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return hadamard_matrix(n).to(device=device, dtype=dtype)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The dense ``n×n`` matrix ``hadamard_transform`` applies (unnormalized), for tests."""
    m, p = _factor_or_raise(n)
    return torch.kron(paley(m), sylvester(p)) if m > 1 else sylvester(p)


def outer_factor(n: int) -> torch.Tensor:
    """The dense factor ``H_m`` of ``hadamard_matrix(n) = kron(H_m, sylvester(n // m))`` (``[[1.]]`` for a
    power of two): what a kernel running the fast transform on the ``2^k`` axis mixes blocks with."""
    m, _ = _factor_or_raise(n)
    return paley(m).clone() if m > 1 else torch.ones(1, 1)


def _factor_or_raise(n: int) -> tuple[int, int]:
    f = factor(n)
    if f is None:
        raise ValueError(f"no Hadamard transform of size {n} here; pad to {supported_size(n)}")
    return f


def hadamard_transform(x: torch.Tensor, inverse: bool = False, fast: bool | None = None) -> torch.Tensor:
    """Orthonormal Hadamard rotation along the last dim: ``x @ H / sqrt(n)`` (``inverse``: ``x @ Hᵀ / sqrt(n)``).

    ``x`` is treated as ``m × 2^k`` blocks: the fast transform runs on the ``2^k`` axis and the small
    Paley matrix mixes the ``m`` axis, which is ``x @ kron(H_m, H_{2^k})``. ``fast=False`` (the default
    up to ``DENSE_MAX``) multiplies by that matrix instead; ``fast=True`` forces the structured path.
    """
    n = x.shape[-1]
    m, p = _factor_or_raise(n)
    if fast is None:
        fast = n > DENSE_MAX or not x.is_floating_point()
    if not fast:  # small (SmolLM2's 192): one matmul with the cached matrix
        h = _hadamard_cached(n, x.dtype, x.device)
        return (x @ (h.T if inverse else h)) * (n**-0.5)
    y = fwht(x) if m == 1 else fwht(x.reshape(*x.shape[:-1], m, p))
    if m > 1:
        h = on_device(paley(m), x.device, x.dtype)
        y = torch.einsum("...ip,ij->...jp", y, h.T if inverse else h).reshape(x.shape)
    return y * (n**-0.5)
