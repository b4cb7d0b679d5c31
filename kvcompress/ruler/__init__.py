"""A RULER-style synthetic long-context benchmark, generated offline, with questions asked after compression.

Modules: ``tasks`` (the tasks: NIAH single / multi-key / multi-value / multi-query, variable tracking, common and
frequent words extraction, QA over planted facts), ``generator`` (examples at a target token length from a seed
and the model's tokenizer), ``scoring`` (RULER's string matching, bootstrap intervals over examples). The LongBench
harness runs it: ``kvcompress eval --benchmark ruler`` (same registry, tables, resume and process shards).
"""

from kvcompress.ruler.generator import DEFAULT_LENGTH, RulerExample, generate, generate_example
from kvcompress.ruler.scoring import example_score, score_task, string_match_all, string_match_part
from kvcompress.ruler.tasks import TASKS, Draw, RulerTask

__all__ = [
    "DEFAULT_LENGTH",
    "TASKS",
    "Draw",
    "RulerExample",
    "RulerTask",
    "example_score",
    "generate",
    "generate_example",
    "score_task",
    "string_match_all",
    "string_match_part",
]
