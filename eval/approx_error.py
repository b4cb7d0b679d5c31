"""Approximation error of CompressKV vs. baselines against exact softmax attention (WildCat Thm. 2, measured).

For each input family, trial and coreset size r the script draws queries Q [m, d], keys K [n, d] and values
V [n, d] in float32 (what a GPU would run), computes the exact attention ``O = softmax(beta Q K^T) V`` in
float64 from the same float32 numbers (``beta = 1/sqrt(d)``), runs every method on the float32 inputs and
reports ``||O - O_hat||_max`` and ``||O - O_hat||_F / ||O||_F`` (mean and sample std over trials).

Input families (rows are i.i.d.; ``g ~ N(0, I_d)``):

* ``gaussian``: q, k, v = g.
* ``heavy_tailed``: k = mu + s * g with a log-normal norm scale ``s = exp(sigma z - sigma^2)``,
  ``z ~ N(0, 1)`` (so ``E[s^2] = 1``; default sigma = 0.5: the largest of 4096 scales is ~5x the median),
  and a shared mean offset ``mu = offset * sqrt(d) * u``, ``u`` uniform on the unit sphere, drawn once per
  tensor (default offset = 1.0: ``|mu|`` equals the typical ``|g|``). Queries are an independent draw of
  the same generator (their own offset direction); values are plain ``g``.

Query scale: after drawing, Q is multiplied by one scalar so that the per-query standard deviation of the
logits ``beta <q_i, k_l>`` over the keys l, averaged over the queries i, equals ``logit_std`` (default 2.0):
attention is then neither uniform nor one-hot.

Methods (all on float32 inputs; ``bins`` of the binned variant = the divisor of r closest to r / 12):

* ``compresskv``: ``compress_kv(K, V, r, bins=1, query_radius=max_i |q_i|)`` (Alg. 4's R_Q), then
  ``weighted_attention`` with ``v_min``/``v_max`` = per-channel min/max of the full V (Alg. 4).
* ``compresskv_binned``: the same with ``bins = binned_bins(r)``.
* ``uniform``: plain softmax over a uniform random subset of r rows (no clipping).
* ``uniform_weighted``: the same subset as ``uniform`` as a weighted coreset of the uniform Nystrom-style
  selection matrix ``W = (n/r) * rows``: ``V_S = (n/r) V_sub``, ``w = n/r``, through ``weighted_attention``
  with the same clipping as CompressKV.
* ``topk_norm``: plain softmax over the r keys of largest L2 norm (raw keys, offset included).

Run from the repository root: ``python -m eval.approx_error`` (defaults in ``configs/approx_error.yaml``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eval.config import load_yaml
from kvcompress import compress_kv, weighted_attention
from kvcompress._checks import check_int_range, check_positive

FAMILIES = ("gaussian", "heavy_tailed")
METHODS = ("compresskv", "compresskv_binned", "uniform", "uniform_weighted", "topk_norm")
# Optional reference (not run by default): the trivial output O_hat = 0, i.e. max|O| and rel. Frobenius error 1.
EXTRA_METHODS = ("zero",)
STYLES = {"uniform_weighted": {"linestyle": "--", "mfc": "none"}, "zero": {"linestyle": ":", "color": "grey"}}
DEFAULT_CONFIG = Path("configs/approx_error.yaml")
CSV_COLUMNS = ("family", "method", "rank", "bins", "max_err", "max_err_std", "rel_fro", "rel_fro_std")


@dataclass
class Config:
    """Run settings; every field is also a YAML key and a ``--flag`` (underscores as hyphens)."""

    n: int = 4096
    d: int = 64
    m: int = 512
    ranks: list[int] = field(default_factory=lambda: [32, 64, 128, 256, 512, 1024])
    trials: int = 3
    seed: int = 0
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    output_dir: str = "results/approx_error"
    logit_std: float = 2.0
    key_norm_sigma: float = 0.5
    key_offset: float = 1.0
    bin_rank: int = 12


@dataclass
class Problem:
    """One draw of float32 inputs, the float64 exact output and the clip range of Alg. 4."""

    queries: torch.Tensor  # [m, d] float32
    keys: torch.Tensor  # [n, d] float32
    values: torch.Tensor  # [n, d] float32
    exact: torch.Tensor  # [m, d] float64
    query_scale: float


@dataclass
class Row:
    """Trial-aggregated errors of one (family, method, rank)."""

    family: str
    method: str
    rank: int
    bins: int | None
    max_errs: list[float]
    rel_fros: list[float]
    seconds: list[float]


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (independent streams per family/trial/rank/purpose)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_rows(family: str, rows: int, d: int, gen: torch.Generator, cfg: Config) -> torch.Tensor:
    """``rows`` i.i.d. float64 rows of ``family`` (see the module docstring for the generator)."""
    g = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    if family == "gaussian":
        return g
    if family == "heavy_tailed":
        sigma = cfg.key_norm_sigma
        scale = torch.exp(sigma * torch.randn(rows, 1, generator=gen, dtype=torch.float64) - sigma**2)
        direction = torch.randn(d, generator=gen, dtype=torch.float64)
        offset = cfg.key_offset * math.sqrt(d) * direction / direction.norm()
        return offset + scale * g
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def exact_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64 with beta = 1/sqrt(d)."""
    q, k, v = (x.to(torch.float64) for x in (queries, keys, values))
    beta = 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(beta * q @ k.T, dim=-1) @ v


def make_problem(family: str, cfg: Config, seed: int) -> Problem:
    """Draw Q, K, V of ``family``, scale Q to the target logit std, and compute the exact output."""
    gen = torch.Generator().manual_seed(seed)
    keys = draw_rows(family, cfg.n, cfg.d, gen, cfg)
    values = torch.randn(cfg.n, cfg.d, generator=gen, dtype=torch.float64)
    queries = draw_rows(family, cfg.m, cfg.d, gen, cfg)
    logit_std = (queries @ keys.T / math.sqrt(cfg.d)).std(dim=-1).mean().item()
    scale = cfg.logit_std / logit_std
    q32, k32, v32 = (x.to(torch.float32) for x in (queries * scale, keys, values))
    return Problem(q32, k32, v32, exact_attention(q32, k32, v32), scale)


def binned_bins(rank: int, n: int, bin_rank: int = 12) -> int:
    """The divisor of ``rank`` closest to ``rank / bin_rank`` (ties: fewer bins) whose bins hold their pivots."""
    target = rank / bin_rank
    divisors = [b for b in range(1, rank + 1) if rank % b == 0 and n // b >= rank // b]
    return min(divisors, key=lambda b: (abs(b - target), b))


def _as4d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, 1, *x.shape)


def clip_range(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min/max of the full V as ``[1, 1, d]`` (Alg. 4)."""
    return values.amin(0).reshape(1, 1, -1), values.amax(0).reshape(1, 1, -1)


def run_compresskv(problem: Problem, rank: int, bins: int, seed: int) -> torch.Tensor:
    """CompressKV (Alg. 2) with R_Q = max query norm, then WtdAttn (Alg. 3) with the full-V clip range."""
    radius = problem.queries.norm(dim=-1).max().item()
    k_s, v_s, w = compress_kv(problem.keys, problem.values, rank, bins=bins, query_radius=radius, seed=seed)
    v_min, v_max = clip_range(problem.values)
    out = weighted_attention(
        _as4d(problem.queries), _as4d(k_s), _as4d(v_s), w.reshape(1, 1, -1), v_min=v_min, v_max=v_max
    )
    return out.reshape(problem.queries.shape[0], -1)


def subset_softmax(problem: Problem, index: torch.Tensor) -> torch.Tensor:
    """Plain float32 softmax attention over the rows ``index`` (no weights, no clipping)."""
    beta = 1.0 / math.sqrt(problem.queries.shape[-1])
    logits = beta * problem.queries @ problem.keys[index].T
    return torch.softmax(logits, dim=-1) @ problem.values[index]


def run_uniform_weighted(problem: Problem, index: torch.Tensor) -> torch.Tensor:
    """The uniform subset as a weighted coreset (W = n/r on the chosen rows) through WtdAttn with clipping."""
    n, rank = problem.keys.shape[0], index.numel()
    k_s, v_s = problem.keys[index], problem.values[index] * (n / rank)
    w = torch.full((1, 1, rank), n / rank, dtype=torch.float32)
    v_min, v_max = clip_range(problem.values)
    out = weighted_attention(_as4d(problem.queries), _as4d(k_s), _as4d(v_s), w, v_min=v_min, v_max=v_max)
    return out.reshape(problem.queries.shape[0], -1)


def errors(exact: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(max-norm error, relative Frobenius error) of ``approx`` against ``exact``, in float64."""
    diff = exact - approx.to(torch.float64)
    return diff.abs().max().item(), (diff.norm() / exact.norm()).item()


def run_method(method: str, problem: Problem, rank: int, bins: int, seed: int, subset: torch.Tensor) -> torch.Tensor:
    """Dispatch one method at coreset size ``rank``."""
    if method == "compresskv":
        return run_compresskv(problem, rank, 1, seed)
    if method == "compresskv_binned":
        return run_compresskv(problem, rank, bins, seed)
    if method == "uniform":
        return subset_softmax(problem, subset)
    if method == "uniform_weighted":
        return run_uniform_weighted(problem, subset)
    if method == "topk_norm":
        return subset_softmax(problem, problem.keys.norm(dim=-1).topk(rank).indices)
    if method == "zero":
        return torch.zeros_like(problem.queries)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS + EXTRA_METHODS}")


def run_benchmark(cfg: Config, log: bool = True) -> list[Row]:
    """All (family, method, rank) cells, each over ``cfg.trials`` independent draws."""
    rows: dict[tuple[str, str, int], Row] = {}
    for family in cfg.families:
        for trial in range(cfg.trials):
            problem = make_problem(family, cfg, derive_seed(cfg.seed, family, trial, "data"))
            if log:
                print(f"[{family} trial {trial}] query scale {problem.query_scale:.3f}", file=sys.stderr)
            for rank in cfg.ranks:
                bins = binned_bins(rank, cfg.n, cfg.bin_rank)
                perm_gen = torch.Generator().manual_seed(derive_seed(cfg.seed, family, trial, rank, "subset"))
                subset = torch.randperm(cfg.n, generator=perm_gen)[:rank].sort().values
                for method in cfg.methods:
                    seed = derive_seed(cfg.seed, family, trial, rank, method)
                    start = time.perf_counter()
                    approx = run_method(method, problem, rank, bins, seed, subset)
                    elapsed = time.perf_counter() - start
                    max_err, rel_fro = errors(problem.exact, approx)
                    row_bins = {"compresskv": 1, "compresskv_binned": bins}.get(method)
                    row = rows.setdefault((family, method, rank), Row(family, method, rank, row_bins, [], [], []))
                    row.max_errs.append(max_err)
                    row.rel_fros.append(rel_fro)
                    row.seconds.append(elapsed)
    return list(rows.values())


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single trial)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def format_table(rows: list[Row], family: str, ranks: list[int], metric: str) -> str:
    """One family's table: rows = methods, columns = ranks, cells = trial-mean ``metric`` (max_err|rel_fro)."""
    picked = [r for r in rows if r.family == family]
    cells = {(r.method, r.rank): mean_std(r.max_errs if metric == "max_err" else r.rel_fros)[0] for r in picked}
    methods = list(dict.fromkeys(r.method for r in picked))
    lines = [
        f"{family}: {metric} (mean over trials)",
        f"{'method':<18}" + "".join(f"{'r=' + str(k):>11}" for k in ranks),
    ]
    for method in methods:
        lines.append(f"{method:<18}" + "".join(f"{cells[(method, k)]:>11.3e}" for k in ranks))
    return "\n".join(lines)


def format_timing(rows: list[Row], family: str, ranks: list[int]) -> str:
    """One family's mean seconds per call (method + attention), rows = methods, columns = ranks."""
    methods = list(dict.fromkeys(r.method for r in rows if r.family == family))
    secs = {(r.method, r.rank): statistics.fmean(r.seconds) for r in rows if r.family == family}
    lines = [f"{family}: seconds per call", f"{'method':<18}" + "".join(f"{'r=' + str(k):>11}" for k in ranks)]
    for method in methods:
        lines.append(f"{method:<18}" + "".join(f"{secs[(method, k)]:>11.3f}" for k in ranks))
    return "\n".join(lines)


def write_csv(rows: list[Row], path: Path) -> None:
    """Long-format CSV: one line per (family, method, rank); bins is blank for methods without bins."""
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for r in rows:
            max_err, max_std = mean_std(r.max_errs)
            rel, rel_std = mean_std(r.rel_fros)
            bins = "" if r.bins is None else r.bins
            writer.writerow(
                [r.family, r.method, r.rank, bins, f"{max_err:.6e}", f"{max_std:.6e}", f"{rel:.6e}", f"{rel_std:.6e}"]
            )


def plot(rows: list[Row], families: list[str], path: Path) -> None:
    """Log-log error vs r: columns = families, rows = (max-norm, relative Frobenius); error bars = trial std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(families), figsize=(5.5 * len(families), 8), squeeze=False)
    for col, family in enumerate(families):
        methods = list(dict.fromkeys(r.method for r in rows if r.family == family))
        for row_idx, (metric, label) in enumerate(
            (("max_errs", "max-norm error"), ("rel_fros", "rel. Frobenius error"))
        ):
            ax = axes[row_idx][col]
            for method in methods:
                cell = sorted((r for r in rows if r.family == family and r.method == method), key=lambda r: r.rank)
                stats = [mean_std(getattr(r, metric)) for r in cell]
                ax.errorbar(
                    [r.rank for r in cell],
                    [s[0] for s in stats],
                    yerr=[s[1] for s in stats],
                    marker="o",
                    ms=3,
                    capsize=2,
                    label=method,
                    **STYLES.get(method, {}),
                )
            if metric == "rel_fros":
                ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":", label="O_hat = 0 level")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("coreset size r")
            ax.set_ylabel(label)
            ax.set_title(f"{family}: {label}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """CLI flags; all default to None so that the YAML config (then the built-in defaults) fill the gaps."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, default=None, help=f"YAML with the same keys (default {DEFAULT_CONFIG})")
    p.add_argument("--n", type=int, help="keys per problem (default 4096)")
    p.add_argument("--d", type=int, help="head dimension (default 64)")
    p.add_argument("--m", type=int, help="queries per problem (default 512)")
    p.add_argument("--ranks", type=int, nargs="+", help="coreset sizes r (default 32 64 128 256 512 1024)")
    p.add_argument("--trials", type=int, help="independent draws per cell (default 3)")
    p.add_argument("--seed", type=int, help="base seed (default 0)")
    p.add_argument("--families", nargs="+", choices=FAMILIES, help="input families (default all)")
    p.add_argument(
        "--methods", nargs="+", choices=METHODS + EXTRA_METHODS, help="methods (default: all but the zero reference)"
    )
    p.add_argument("--output-dir", help="where approx_error.csv/.png go (default results/approx_error)")
    p.add_argument("--logit-std", type=float, help="target per-query std of beta<q,k> over keys (default 2.0)")
    p.add_argument(
        "--key-norm-sigma", type=float, help="heavy_tailed: log-normal sigma of the norm scale (default 0.5)"
    )
    p.add_argument("--key-offset", type=float, help="heavy_tailed: |mean offset| / sqrt(d) (default 1.0)")
    p.add_argument(
        "--bin-rank", type=int, help="compresskv_binned: bins = divisor of r closest to r / bin_rank (default 12)"
    )
    return p


def resolve_config(argv: list[str] | None = None) -> Config:
    """Built-in defaults < YAML config < command-line flags, validated."""
    args = vars(build_parser().parse_args(argv))
    merged = {
        **load_yaml(args.pop("config"), DEFAULT_CONFIG, Config),
        **{k: v for k, v in args.items() if v is not None},
    }
    cfg = Config(**merged)
    for name in ("families", "methods"):
        bad = set(getattr(cfg, name)) - set(FAMILIES if name == "families" else METHODS + EXTRA_METHODS)
        if bad:
            raise ValueError(f"{name}: unknown {sorted(bad)}")
    for name in ("n", "d", "m", "trials", "bin_rank"):
        check_int_range(name, getattr(cfg, name), 1)
    for rank in cfg.ranks:
        check_int_range("ranks", rank, 1, cfg.n)
    check_positive("logit_std", cfg.logit_std)
    check_positive("key_norm_sigma", cfg.key_norm_sigma)
    if not (isinstance(cfg.key_offset, (int, float)) and math.isfinite(cfg.key_offset) and cfg.key_offset >= 0):
        raise ValueError(f"key_offset: must be a finite number >= 0, got {cfg.key_offset!r}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the tables and write the CSV and the plot."""
    try:
        cfg = resolve_config(argv)
    except ValueError as exc:  # a config key or flag out of range: one line naming it (--n for n, ...)
        raise SystemExit(f"approx_error: {exc}") from None
    print(f"config: {asdict(cfg)}")
    start = time.perf_counter()
    rows = run_benchmark(cfg)
    total = time.perf_counter() - start
    for family in cfg.families:
        for metric in ("max_err", "rel_fro"):
            print("\n" + format_table(rows, family, cfg.ranks, metric))
        print("\n" + format_timing(rows, family, cfg.ranks))
    bins = {r: binned_bins(r, cfg.n, cfg.bin_rank) for r in cfg.ranks}
    print(f"\ncompresskv_binned bins per rank: {bins}")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "approx_error.csv")
    plot(rows, cfg.families, out_dir / "approx_error.png")
    print(f"wrote {out_dir / 'approx_error.csv'} and {out_dir / 'approx_error.png'}; total {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
