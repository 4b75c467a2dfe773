"""Compare candidate outputs with reference outputs, in the harness process only."""

from __future__ import annotations

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


def compare_outputs(reference: list, candidate: list, cfg: CorrectnessConfig) -> Comparison:
    """Structure, shape, dtype, then values: |c - r| <= atol + rtol * |r|, NaN where the reference has NaN."""
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
        rd, cd = r.to(torch.float64), c.to(torch.float64)
        nan_r, nan_c = torch.isnan(rd), torch.isnan(cd)
        diff = (cd - rd).abs()
        diff = torch.where(torch.isinf(rd) & (cd == rd), torch.zeros_like(diff), diff)
        bad = (diff > atol + rtol * rd.abs()) | (nan_r != nan_c) | (torch.isnan(diff) & ~nan_r)
        finite = ~(nan_r | nan_c) & torch.isfinite(diff)
        max_abs = float(diff[finite].max()) if finite.any() else 0.0
        rel = diff[finite] / rd.abs()[finite].clamp_min(1e-12)
        total.max_abs_error = max(total.max_abs_error, max_abs)
        total.max_rel_error = max(total.max_rel_error, float(rel.max()) if rel.numel() else 0.0)
        total.mismatched += int(bad.sum())
        total.numel += r.numel()
        if bad.any() and total.ok:
            total.ok = False
            total.reason = (f"output {i}: {int(bad.sum())}/{r.numel()} elements outside atol={atol:g} rtol={rtol:g} "
                            f"(max abs error {max_abs:.3g})")
    return total


def compare_fingerprints(reference: torch.Tensor, candidate: torch.Tensor, cfg: CorrectnessConfig,
                         dtypes: list[torch.dtype]) -> bool:
    """Fingerprints (see hpc.runner.inputs.fingerprint) agree within the bound the elementwise tolerance implies."""
    if not isinstance(candidate, torch.Tensor) or candidate.shape != reference.shape:
        return False
    for row_r, row_c, dtype in zip(reference, candidate, dtypes):
        atol, rtol = tolerances(dtype, cfg)
        n, abs_sum = float(row_r[4]), float(row_r[1])
        bound = 3.0 * (n * atol + rtol * abs_sum) + 1e-9 * abs_sum
        if bool(torch.isnan(row_c[:3]).any()) or row_c[3] != row_r[3] or row_c[4] != row_r[4]:
            return False
        if bool(((row_c[:3] - row_r[:3]).abs() > bound).any()):
            return False
    return True
