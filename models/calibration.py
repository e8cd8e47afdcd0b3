"""Fitting a head's calibration on held-out rows: the {temperature, bias} a `HeadBundle` applies as
sigmoid(z / T + b) (models.heads), kept apart from the networks because only train fits it."""

from __future__ import annotations

import torch

from utils.cli import UserError


def fit_calibration(logits: torch.Tensor, labels: torch.Tensor, mode: str = "platt", weights=None) -> dict:
    """{temperature, bias} minimising the (weighted) BCE of sigmoid(z / T + b) on held-out rows (soft labels allowed).

    `temperature`: b = 0 (Guo et al.'s temperature scaling); `platt`: T and b; `none`: identity.
    """
    if mode == "none":
        return {"temperature": 1.0, "bias": 0.0, "mode": mode}
    if mode not in ("temperature", "platt"):
        raise UserError(f"calibration must be none, temperature or platt, got '{mode}'")
    z, y = logits.detach().double().flatten(), labels.detach().double().flatten()
    w = torch.ones_like(z) if weights is None else torch.as_tensor(weights).double().flatten()
    log_t = torch.zeros((), dtype=torch.double, requires_grad=True)
    b = torch.zeros((), dtype=torch.double, requires_grad=mode == "platt")
    params = [log_t] + ([b] if mode == "platt" else [])
    opt = torch.optim.LBFGS(params, lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(z / log_t.exp() + b, y, reduction="none") * w).sum() / w.sum()
        loss.backward()
        return loss

    opt.step(closure)
    t = float(log_t.detach().exp())
    if not (0 < t < float("inf")) or t != t:
        return {"temperature": 1.0, "bias": 0.0, "mode": "none"}
    return {"temperature": t, "bias": float(b.detach()), "mode": mode}
