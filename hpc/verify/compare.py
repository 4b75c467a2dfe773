"""Compare candidate outputs with reference outputs, never in a process that runs candidate code:
in the harness, or on cuda in the reference's worker, which holds the expected outputs on the
device (comparing a 256 MB output on the host takes seconds, on the device milliseconds)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hpc.config import CorrectnessConfig

HALF = (torch.float16, torch.bfloat16)


@dataclass
class Comparison:
    ok: bool
    reason: str = ""
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    mismatched: int = 0
    numel: int = 0


def tolerances(dtype: torch.dtype, cfg: CorrectnessConfig) -> tuple[float, float]:
    if dtype in HALF:
        return cfg.atol_half, cfg.rtol_half
    if dtype.is_floating_point or dtype.is_complex:
        return cfg.atol_fp32, cfg.rtol_fp32
    return 0.0, 0.0


def magnitude(mean_abs: float) -> float:
    """The unit atol is counted in: max(1, mean |reference|).

    Rounding error of a float32 reduction grows with the magnitude of its partial sums, whatever the
    summation order: two correct kernels for a K=4096 matmul of unit normals (outputs ~64) differ
    by ~1e-4 absolute near zero outputs. A fixed absolute atol would fail a correct kernel there;
    atol in units of the output's scale does not, and still fails a tf32 or half-precision one.
    """
    return max(1.0, mean_abs) if math.isfinite(mean_abs) else 1.0


def compare_outputs(reference: list, candidate: list, cfg: CorrectnessConfig,
                    device: str | torch.device = "cpu") -> Comparison:
    """Structure, shape, dtype, then values: |c - r| <= atol * max(1, mean |r|) + rtol * |r|, NaN
    where the reference has NaN. Values are compared on `device`, one output at a time."""
    if not isinstance(candidate, list) or len(candidate) != len(reference):
        n = len(candidate) if isinstance(candidate, list) else "?"
        return Comparison(False, f"returned {n} outputs, expected {len(reference)}")
    total = Comparison(True)
    for i, (r, c) in enumerate(zip(reference, candidate)):
        if not isinstance(c, torch.Tensor):
            return Comparison(False, f"output {i} is {type(c).__name__}, expected a tensor")
        if c.shape != r.shape:
            return Comparison(False, f"output {i} has shape {tuple(c.shape)}, expected {tuple(r.shape)}")
        if c.dtype != r.dtype:
            return Comparison(False, f"output {i} has dtype {c.dtype}, expected {r.dtype}")
        atol, rtol = tolerances(r.dtype, cfg)
        # float32 arithmetic suffices for float32 and half outputs (|c - r| of close values is exact);
        # float64 only for float64 and integer outputs
        wide = torch.float64 if r.dtype == torch.float64 or not r.is_floating_point() else torch.float32
        rd, cd = r.to(device, wide), c.to(device, wide)
        nan_r, nan_c = torch.isnan(rd), torch.isnan(cd)
        abs_r, finite_r = rd.abs(), torch.isfinite(rd)
        n_finite = int(finite_r.sum())
        mean_abs = float(torch.where(finite_r, abs_r, 0).sum(dtype=torch.float64)) / n_finite if n_finite else 1.0
        atol = atol * magnitude(mean_abs)
        diff = (cd - rd).abs()
        diff = torch.where(torch.isinf(rd) & (cd == rd), torch.zeros_like(diff), diff)
        bad = (diff > atol + rtol * abs_r) | (nan_r != nan_c) | (torch.isnan(diff) & ~nan_r)
        finite = ~(nan_r | nan_c) & torch.isfinite(diff)
        max_abs = float(torch.where(finite, diff, 0).max()) if diff.numel() else 0.0
        max_rel = float(torch.where(finite, diff / abs_r.clamp_min(1e-12), 0).max()) if diff.numel() else 0.0
        total.max_abs_error = max(total.max_abs_error, max_abs)
        total.max_rel_error = max(total.max_rel_error, max_rel)
        total.mismatched += int(bad.sum())
        total.numel += r.numel()
        if bad.any() and total.ok:
            total.ok = False
            total.reason = (f"output {i}: {int(bad.sum())}/{r.numel()} elements outside atol={atol:g} rtol={rtol:g} "
                            f"(max abs error {max_abs:.3g})")
    return total
