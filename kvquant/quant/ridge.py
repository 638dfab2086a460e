"""Closed-form ridge regression with an unpenalized bias, in fp32 (AQUA-KV's predictors).

``W = (XcᵀXc + λ·mean(diag XcᵀXc)·I)⁻¹ XcᵀYc`` on centred data, ``b = mean(Y) − mean(X)·W``: scaling
λ by the mean diagonal makes it independent of the inputs' magnitude, and centring keeps the bias
out of the penalty. Statistics accumulate over batches, so calibration never holds ``X`` whole in
one matrix product.

Pure torch.
"""

from __future__ import annotations

import torch

DEFAULT_LAMBDA = 1e-3


class RidgeStats:
    """Running sums for ``fit``: ``Σx``, ``Σy``, ``ΣxᵀX``, ``ΣxᵀY`` and the row count, in fp64."""

    def __init__(self, n_in: int, n_out: int, device: torch.device | str = "cpu"):
        kw = {"dtype": torch.float64, "device": device}
        self.sx, self.sy = torch.zeros(n_in, **kw), torch.zeros(n_out, **kw)
        self.xx, self.xy = torch.zeros(n_in, n_in, **kw), torch.zeros(n_in, n_out, **kw)
        self.n = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows ``x`` (``[N, n_in]``) with targets ``y`` (``[N, n_out]``)."""
        x, y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.xx += x.T @ x
        self.xy += x.T @ y
        self.n += x.shape[0]

    def fit(self, lam: float = DEFAULT_LAMBDA) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W [n_in, n_out], b [n_out])`` in fp32, so that ``y ≈ x @ W + b``."""
        if self.n == 0:
            raise ValueError("ridge: no rows to fit")
        mx, my = self.sx / self.n, self.sy / self.n
        xx = (self.xx - self.n * torch.outer(mx, mx)).float()
        xy = (self.xy - self.n * torch.outer(mx, my)).float()
        reg = lam * xx.diagonal().mean().clamp_min(torch.finfo(torch.float32).tiny)
        w = torch.linalg.solve(xx + reg * torch.eye(xx.shape[0], device=xx.device), xy)
        b = my.float() - mx.float() @ w
        return w, b


def ridge(x: torch.Tensor, y: torch.Tensor, lam: float = DEFAULT_LAMBDA) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit ``y ≈ x @ W + b`` in one call (``x``: ``[N, n_in]``, ``y``: ``[N, n_out]``)."""
    stats = RidgeStats(x.shape[-1], y.shape[-1], x.device)
    stats.add(x, y)
    return stats.fit(lam)
