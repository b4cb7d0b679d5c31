"""Real-model fidelity study of KV-cache presses: next-token KL, top-1 agreement, planted facts, layer errors,
cache bytes and prefill time, with bootstrap intervals over seeded real-text contexts.

Modules: ``contexts`` (texts, needles, tokenisation), ``specs`` (press specs -> presses), ``probes`` (queries,
bytes, masks), ``measure`` (one prefill + all metrics), ``study`` (the resumable loop), ``stats`` (bootstrap),
``report`` (tables, CSV, JSON, plot). The model is loaded by the caller (``eval/fidelity.py``).
"""

from kvcompress.fidelity.specs import NAMES, PressSpec, check_specs, make_press, parse_spec
from kvcompress.fidelity.stats import bootstrap_mean, bootstrap_ratio

__all__ = ["NAMES", "PressSpec", "bootstrap_mean", "bootstrap_ratio", "check_specs", "make_press", "parse_spec"]
