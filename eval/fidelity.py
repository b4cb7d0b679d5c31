"""Real-model fidelity of KV-cache presses: next-token KL, top-1 agreement, planted facts, layer errors.

For each context (a slice of CPython's ``pydoc_data.topics`` text with one planted fact, wrapped in the
chat template and tokenized exactly as kvpress's pipeline does) and each press at each kept fraction,
the context is prefilled once under the press and then:

* ``kl`` / ``top1``: the true continuation of the text is teacher-forced at its true positions; mean
  KL(exact || press) of the next-token distributions and the fraction of positions whose argmax agrees
  with the exact cache's.
* ``fact``: "What is the secret passcode?" (not compressed) is answered greedily by kvpress's own
  answer loop; 1 if the planted 4-digit code appears in the answer as a whole number.
* ``prefill_ratio``: prefill time with the press over a plain prefill without (same process; on a shared CPU
  an indication only: docs/BENCHMARKS.md has whole-process A/B timings).
* ``cache_mib``: bytes held by the compressed cache (keys, values and, for weighted caches, weights).
* per-layer attention error: the last ``probes`` context queries (post-RoPE) attend the whole context
  without a causal mask (they stand in for future queries); relative Frobenius error of the press's
  (weighted) attention over its compressed rows against exact attention over all rows.

Run from the repository root: ``python -m eval.fidelity`` (defaults in ``configs/fidelity.yaml``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import pydoc_data.topics
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import yaml
from kvpress import KnormPress, SnapKVPress, StreamingLLMPress
from kvpress.utils import get_prerope_query_states
from transformers import DynamicCache, pipeline
from transformers.models.llama.modeling_llama import rotate_half

from eval.config import load_yaml
from eval.models import load_model
from kvcompress import CompressKVPress, UniformPress, weighted_attention
from kvcompress.cache import WeightedLayer

DEFAULT_CONFIG = Path("configs/fidelity.yaml")
FACT = "\n\nIMPORTANT: the secret passcode is {code}.\n\n"
QUESTION = "What is the secret passcode? Answer with the number only."


def found(code: int, answer: str) -> float:
    """1.0 if ``code`` is one of the whole numbers in ``answer`` ("1234567890" does not contain 7890)."""
    return float(str(code) in re.findall(r"\d+", answer))


def make_press(name: str, kept: float, seed: int, window_size: int = 32):
    """A press keeping ``kept`` of the cache (kvpress ``compression_ratio = 1 - kept``); ``window_size`` is the
    recency window our presses keep exactly (the kvpress presses ignore it)."""
    ratio = 1.0 - kept
    ours = dict(compression_ratio=ratio, window_size=window_size, seed=seed)
    presses = {
        "exact": lambda: None,
        "compresskv_queries": lambda: CompressKVPress(query_radius="queries", **ours),
        "compresskv_keys": lambda: CompressKVPress(query_radius="keys", **ours),
        "uniform": lambda: UniformPress(**ours),
        "uniform_weighted": lambda: UniformPress(weighted=True, **ours),
        "snapkv": lambda: SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
        "streamingllm": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "knorm": lambda: KnormPress(compression_ratio=ratio),
    }
    if name not in presses:
        raise ValueError(f"presses: unknown press {name!r}; choose from {sorted(presses)}")
    return presses[name]()


@dataclass
class Config:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    presses: list[str] = field(
        default_factory=lambda: [
            "compresskv_queries",
            "compresskv_keys",
            "uniform",
            "uniform_weighted",
            "snapkv",
            "streamingllm",
            "knorm",
        ]
    )
    kept: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.1])
    contexts: int = 2
    context_tokens: int = 2000
    continuation_tokens: int = 64
    probes: int = 64
    window_size: int = 32  # recency window of our presses (compresskv_*, uniform*)
    max_new_tokens: int = 16
    seed: int = 0
    output_dir: str = "results/fidelity"


@dataclass
class Context:
    ids: torch.Tensor  # [1, n] the chat-templated context, as kvpress's pipeline tokenizes it
    question: torch.Tensor  # [1, q] question + the rest of the chat template
    continuation: torch.Tensor  # [1, c] the text's true next tokens
    code: int


def make_contexts(pipe, cfg: Config) -> list[Context]:
    """Slices of pydoc_data.topics with a planted passcode between 25% and 75% of the context,
    tokenized by the kvpress pipeline ``pipe`` (chat template; the question is not part of the context)."""
    tokenizer = pipe.tokenizer
    corpus = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(corpus, add_special_tokens=False)["input_ids"]
    rng = random.Random(cfg.seed)
    span = cfg.context_tokens + cfg.continuation_tokens
    contexts = []
    for _ in range(cfg.contexts):
        start = rng.randrange(0, len(ids) - span)
        piece = ids[start : start + cfg.context_tokens]
        cut = rng.randrange(cfg.context_tokens // 4, 3 * cfg.context_tokens // 4)
        code = rng.randrange(1000, 10000)
        text = tokenizer.decode(piece[:cut]) + FACT.format(code=code) + tokenizer.decode(piece[cut:])
        inputs = pipe.preprocess(text, [QUESTION], answer_prefix="", max_context_length=10**9)
        context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
        continuation = torch.tensor([ids[start + cfg.context_tokens : start + span]])
        contexts.append(Context(context_ids, question_ids, continuation, code))
    return contexts


class QueryRecorder:
    """Forward hooks that keep the last ``probes`` post-RoPE queries of every layer's prefill."""

    def __init__(self, model, probes: int):
        self.queries: dict[int, torch.Tensor] = {}
        self.hooks = [
            layer.self_attn.register_forward_hook(self._record, with_kwargs=True) for layer in model.model.layers
        ]
        self.probes = probes

    def _record(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"][:, -self.probes :]
        cos, sin = (x[:, -self.probes :] for x in kwargs["position_embeddings"])
        queries = get_prerope_query_states(module, hidden)
        self.queries[module.layer_idx] = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


@torch.no_grad()
def prefill(model, press, ids: torch.Tensor) -> tuple[DynamicCache, float]:
    cache = DynamicCache()
    start = time.perf_counter()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
    return cache, time.perf_counter() - start


@torch.no_grad()
def continuation_logprobs(model, cache, context_len: int, continuation: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probs ``[c, vocab]`` at the continuation's true positions."""
    positions = torch.arange(context_len, context_len + continuation.shape[1])[None]
    logits = model(input_ids=continuation, past_key_values=cache, position_ids=positions).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        total += layer.keys.nbytes + layer.values.nbytes
        if isinstance(layer, WeightedLayer):
            total += layer.row_weights.nbytes
    return total


def layer_errors(model, full_cache, cache, queries: dict[int, torch.Tensor]) -> list[float]:
    """Relative Frobenius error per layer of the probes' attention over ``cache`` vs ``full_cache``."""
    errors = []
    for idx, (full, layer) in enumerate(zip(full_cache.layers, cache.layers, strict=True)):
        module = model.model.layers[idx].self_attn
        q = queries[idx].float()
        exact = weighted_attention(
            q, full.keys.float(), full.values.float(), torch.ones(full.keys.shape[:3]), scaling=module.scaling
        )
        if isinstance(layer, WeightedLayer):
            approx = weighted_attention(
                q,
                layer.keys.float(),
                layer.values.float(),
                layer.row_weights,
                scaling=module.scaling,
                v_min=layer.value_min,
                v_max=layer.value_max,
            )
        else:
            approx = weighted_attention(
                q, layer.keys.float(), layer.values.float(), torch.ones(layer.keys.shape[:3]), scaling=module.scaling
            )
        errors.append(((approx - exact).norm() / exact.norm()).item())
    return errors


def measure(pipe, press, ctx: Context, cfg: Config, reference: dict | None = None) -> dict:
    """One prefill under ``press`` (None: exact), then every metric on that cache.

    The continuation is teacher-forced on a copy of the cache; the question is answered by kvpress's
    own greedy loop (``pipe.generate_answer``) on the cache itself, as its pipeline does.
    """
    model, n = pipe.model, ctx.ids.shape[1]
    recorder = QueryRecorder(model, cfg.probes) if press is None else None
    cache, seconds = prefill(model, press, ctx.ids)
    if recorder is not None:
        recorder.remove()
    result = dict(cache_mib=cache_bytes(cache) / 2**20, seconds=seconds)
    result["logp"] = continuation_logprobs(model, copy.deepcopy(cache), n, ctx.continuation)
    if reference is None:  # keep the exact cache as it is after the prefill: the reference of every layer error
        result.update(queries=recorder.queries, cache=copy.deepcopy(cache), layer_errors=[0.0] * len(cache.layers))
    else:
        result["layer_errors"] = layer_errors(model, reference["cache"], cache, reference["queries"])
    with torch.no_grad():
        result["answer"] = pipe.generate_answer(ctx.question, cache, n, cfg.max_new_tokens)
    return result


def run(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Measure every (press, kept fraction, context); returns (per-run rows, per-layer rows)."""
    model, tokenizer = load_model(cfg.model)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    records, layer_rows = [], []
    for ci, ctx in enumerate(make_contexts(pipe, cfg)):
        exact = measure(pipe, None, ctx, cfg)
        # Time the exact prefill again without the query-recording hooks: the denominator of prefill_ratio.
        exact["seconds"] = prefill(model, None, ctx.ids)[1]
        settings = [("exact", 1.0)] + [(name, kept) for name in cfg.presses for kept in cfg.kept]
        print(f"[context {ci}] {ctx.ids.shape[1]} tokens, code {ctx.code}", flush=True)
        for name, kept in settings:
            press = make_press(name, kept, cfg.seed + ci, cfg.window_size)
            out = exact if press is None else measure(pipe, press, ctx, cfg, reference=exact)
            kl = torch.sum(exact["logp"].exp() * (exact["logp"] - out["logp"]), dim=-1)
            records.append(
                dict(
                    press=name,
                    kept=kept,
                    context=ci,
                    kl=kl.mean().item(),
                    top1=(out["logp"].argmax(-1) == exact["logp"].argmax(-1)).float().mean().item(),
                    fact=found(ctx.code, out["answer"]),
                    prefill_ratio=out["seconds"] / exact["seconds"],
                    cache_mib=out["cache_mib"],
                    answer=out["answer"],
                )
            )
            errors = out["layer_errors"]
            layer_rows += [dict(press=name, kept=kept, context=ci, layer=i, rel_err=e) for i, e in enumerate(errors)]
            print(
                f"  {name:<20} kept={kept:<5} KL={kl.mean().item():.4f} layer err={statistics.mean(errors):.4f} "
                f"answer={out['answer']!r}",
                flush=True,
            )
    return records, layer_rows


def summarize(records: list[dict], layer_rows: list[dict]) -> list[dict]:
    """Means over contexts per (press, kept)."""
    keys = sorted({(r["press"], r["kept"]) for r in records}, key=lambda k: (-k[1], k[0]))
    table = []
    for press, kept in keys:
        rows = [r for r in records if r["press"] == press and r["kept"] == kept]
        layer = [r["rel_err"] for r in layer_rows if r["press"] == press and r["kept"] == kept]
        table.append(
            dict(
                press=press,
                kept=kept,
                **{
                    m: statistics.mean(r[m] for r in rows) for m in ("kl", "top1", "fact", "prefill_ratio", "cache_mib")
                },
                layer_err=statistics.mean(layer) if layer else 0.0,
            )
        )
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| press | kept | KL(exact‖press) | top-1 agree | fact acc | prefill time ratio | cache MiB | mean layer err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['press']} | {r['kept']:g} | {r['kl']:.4f} | {r['top1']:.3f} | {r['fact']:.2f} | "
            f"{r['prefill_ratio']:.2f} | {r['cache_mib']:.1f} | {r['layer_err']:.4f} |"
        )
    return "\n".join(lines)


def parse_config(argv: list[str] | None = None) -> Config:
    """Built-in defaults < YAML config (``--config``, default configs/fidelity.yaml) < command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help=f"YAML with the same keys (default {DEFAULT_CONFIG})")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("presses", "kept"):
            parser.add_argument(flag, nargs="+", type=float if f.name == "kept" else str)
        else:
            parser.add_argument(flag, type=str if f.name in ("model", "output_dir") else int)
    args = vars(parser.parse_args(argv))
    values = load_yaml(args.pop("config"), DEFAULT_CONFIG, Config)
    values.update({k: v for k, v in args.items() if v is not None})
    return Config(**values)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    for name in cfg.presses:
        make_press(name, 0.5, 0)  # fail fast on a misspelt press
    records, layer_rows = run(cfg)
    table = summarize(records, layer_rows)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for filename, rows in (("fidelity_runs.csv", records), ("fidelity.csv", table), ("layer_errors.csv", layer_rows)):
        with open(out / filename, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    (out / "config.yaml").write_text(yaml.safe_dump(asdict(cfg)))
    text = markdown(table)
    (out / "fidelity.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
