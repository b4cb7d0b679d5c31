"""The continuation study's KL by stretch of the continuation, from runs of
``results/frontier/patches/continuation_prefixes.py`` (rows with ``kl_128``, ``kl_256`` and the whole ``kl`` of a
512-token continuation): per stretch the two presses' mean KL, the ratio of means with a 95% bootstrap interval
over contexts, how many contexts are above ``BOUND`` x the baseline's KL, the worst and the median ratio; then the
contexts above it over their first 128 tokens; then, where the rows have ``kl_bins``, both presses' mean KL and
their ratio per stretch of the patch's ``BIN`` tokens.

    python results/frontier/diagnosis/continuation_segments.py PRESS BASELINE BOUND RUN_DIR [RUN_DIR ...]
"""
import json
import random
import statistics
import sys
from pathlib import Path

BIN = 32  # the patch's stretch


def per_stretch(row: dict) -> dict[str, float]:
    """Mean KL over tokens 1-128, 1-256, 1-512, and over 129-256 and 257-512 alone; with ``kl_bins`` also over
    tokens 1-32, 33-128 and 129-512."""
    first, second, whole = row["kl_128"], row["kl_256"], row["kl"]
    out = {
        "1-128": first, "1-256": second, "1-512": whole, "129-256": 2 * second - first, "257-512": 2 * whole - second
    }  # fmt: skip
    bins = row.get("kl_bins")
    if bins:
        one, upto128 = 32 // BIN, 128 // BIN
        out.update({
            "1-32": statistics.mean(bins[:one]), "33-128": statistics.mean(bins[one:upto128]),
            "129-512": statistics.mean(bins[upto128:]),
        })  # fmt: skip
    return out


def main(argv: list[str], resamples: int = 2000) -> None:
    press, baseline, bound = argv[0], argv[1], float(argv[2])
    contexts, bins = [], []
    for run in argv[3:]:
        rows: dict[str, dict] = {}
        for line in (Path(run) / "runs.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["context"], {})[row["press"]] = row
        contexts += [(f"{name} ({run})", per_stretch(r[press]), per_stretch(r[baseline])) for name, r in rows.items()]
        bins += [(r[press].get("kl_bins"), r[baseline].get("kl_bins")) for r in rows.values()]
    rng = random.Random(0)
    print(f"{len(contexts)} contexts; stretch: {press} KL, {baseline} KL, ratio of means [95%], above {bound}x, "
          "worst, median")  # fmt: skip
    for stretch in min((c[1] for c in contexts), key=len):
        def ratio(sample, stretch=stretch):
            return statistics.mean(c[1][stretch] for c in sample) / statistics.mean(c[2][stretch] for c in sample)

        draws = sorted(ratio([rng.choice(contexts) for _ in contexts]) for _ in range(resamples))
        each = [c[1][stretch] / c[2][stretch] for c in contexts]
        print(f"{stretch}: {statistics.mean(c[1][stretch] for c in contexts):.4f} "
              f"{statistics.mean(c[2][stretch] for c in contexts):.4f} {ratio(contexts):.3f} "
              f"[{draws[int(0.025 * resamples)]:.3f}, {draws[int(0.975 * resamples) - 1]:.3f}] "
              f"{sum(r > bound for r in each)} {max(each):.2f} {statistics.median(each):.2f}")  # fmt: skip
    print(f"above {bound}x over tokens 1-128: ratio over 1-128 / 1-256 / 1-512")
    for name, ours, theirs in sorted(contexts, key=lambda c: -c[1]["1-128"] / c[2]["1-128"]):
        if ours["1-128"] > bound * theirs["1-128"]:
            print(name, " / ".join(f"{ours[s] / theirs[s]:.2f}" for s in ("1-128", "1-256", "1-512")))
    if all(ours and theirs for ours, theirs in bins):
        print(f"per stretch of {BIN} tokens: {press} KL, {baseline} KL, ratio of means")
        for i in range(len(bins[0][0])):
            ours, theirs = (statistics.mean(b[side][i] for b in bins) for side in (0, 1))
            print(f"{i * BIN + 1}-{(i + 1) * BIN}: {ours:.4f} {theirs:.4f} {ours / theirs:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
