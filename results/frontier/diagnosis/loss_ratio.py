"""How much of a press's loss against the full cache another press has, on the RULER-style contexts all three runs
share: ``(full - press) / (full - baseline)`` of the task-averaged scores, with a 95% bootstrap interval (contexts
resampled within each task, the three presses the same draw).

    PYTHONPATH=. python results/frontier/diagnosis/loss_ratio.py FULL_RUNS exact PRESS_RUNS compresskv \
        BASELINE_RUNS keydiff        # comma-separated runs of one setting are pooled, as in eval.ruler_paired
"""
import random
import statistics
import sys

from eval.ruler_paired import pooled_scores


def averages(sample: dict[str, list[tuple[float, ...]]]) -> list[float]:
    """Each setting's average over the tasks of its per-task means."""
    return [statistics.mean(statistics.mean(row[i] for row in rows) for rows in sample.values()) for i in range(3)]


def main(argv: list[str], resamples: int = 2000) -> None:
    answers: dict = {}
    full, press, baseline = (pooled_scores(argv[i].split(","), argv[i + 1], answers) for i in (0, 2, 4))
    sample = {t: [(full[t][k], press[t][k], baseline[t][k]) for k in full[t] if k in press[t] and k in baseline[t]]
              for t in sorted(full)}  # fmt: skip

    def ratio(s: dict) -> float:
        f, p, b = averages(s)
        return (f - p) / (f - b)

    rng = random.Random(0)
    draws = sorted(ratio({t: [rng.choice(rows) for _ in rows] for t, rows in sample.items()}) for _ in range(resamples))
    f, p, b = averages(sample)
    print(f"contexts per task: {({t: len(rows) for t, rows in sample.items()})}")
    print(f"{argv[1]} {f:.1f}, {argv[3]} {p:.1f}, {argv[5]} {b:.1f}: {argv[3]} loses {ratio(sample):.2f}x what "
          f"{argv[5]} loses [{draws[int(0.025 * resamples)]:.2f}, {draws[int(0.975 * resamples) - 1]:.2f}]")


if __name__ == "__main__":
    main(sys.argv[1:])
