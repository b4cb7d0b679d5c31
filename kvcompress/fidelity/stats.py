"""Percentile bootstrap over contexts: means and paired ratios with 95% intervals (numpy, seeded)."""

from __future__ import annotations

import numpy as np


def resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, n]`` int64 indices drawn with replacement from ``range(n)``; the same for the same arguments,
    so two samples of ``n`` aligned contexts resampled with one seed are paired."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: must be an int >= 1, got {n!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples: must be an int >= 1, got {resamples!r}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_mean(values, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean of ``values`` and its percentile bootstrap interval.

    ``values``: ``[n]`` (one number per context) or ``[n, t]`` (``t`` trials per context: a context is resampled
    with all its trials, and the mean is over every trial).
    """
    data = np.asarray(values, dtype=np.float64)
    if data.ndim not in (1, 2) or data.shape[0] == 0:
        raise ValueError(f"values: expected [n] or [n, t] with n >= 1, got shape {data.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level: must be in (0, 1), got {level!r}")
    per_context = data if data.ndim == 1 else data.mean(axis=1)
    means = per_context[resample_indices(len(per_context), resamples, seed)].mean(axis=1)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(per_context.mean()), float(lo), float(hi)


def bootstrap_ratio(
    numerator, denominator, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """``(ratio, lo, hi)``: ``mean(numerator) / mean(denominator)`` over paired ``[n]`` samples, its interval from
    resampling the same contexts for both. Resamples whose denominator is 0 are left out."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.shape[0] == 0:
        raise ValueError(f"numerator, denominator: expected two [n] samples, n >= 1, got {a.shape} and {b.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level: must be in (0, 1), got {level!r}")
    idx = resample_indices(len(a), resamples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[idx].mean(axis=1) / b[idx].mean(axis=1)
        point = a.mean() / b.mean()
    ratios = np.where(np.isfinite(ratios), ratios, np.nan)
    tail = 100 * (1 - level) / 2
    lo, hi = np.nanpercentile(ratios, [tail, 100 - tail]) if np.isfinite(ratios).any() else (np.nan, np.nan)
    return float(point), float(lo), float(hi)


def context_ratios(ours, base) -> tuple[np.ndarray, np.ndarray]:
    """Per-context ratios ``ours / base`` and the boolean mask of the contexts they cover: those where ``base`` > 0
    (a context the baseline reproduces exactly would make an infinite ratio; every per-context reading leaves it
    out, the ratio of means keeps it)."""
    ours, base = np.asarray(ours, dtype=float), np.asarray(base, dtype=float)
    kept = base > 0
    return ours[kept] / base[kept], kept
