"""Chat prompts under compression, against the full cache (docs/BENCHMARKS.md, "Short chat prompts"): ten
one-line prompts (35-41 tokens with the chat template) and ten documentation-summary prompts (a system prompt and a
pydoc topic, 200-400 tokens). For each press and ratio: the mean KL(full || press) over the full cache's 40-token
greedy answer, teacher-forced (the fidelity study's measure on chat prompts), and the press's own 40-token greedy
answer (empty answers; distinct 3-grams of 38, a loop's signature). Not part of the library: a record of how the
first-token fix and ``novelty_value_norm`` were checked. Run from the repository root:
``python results/frontier/patches/chat_prompts_kl.py [OUT.jsonl]`` (one process, CPU, about 10 minutes)."""

import json
import pydoc_data.topics
import sys

import torch

from kvcompress.fidelity.measure import continuation_logprobs, prefill
from kvcompress.models import load_model
from kvcompress.registry import make_press

torch.set_num_threads(1)
model, tok = load_model()
SHORT = [
    "Tell a long story.", "Write a poem about the sea.", "Explain how a rainbow forms.", "Count from one to fifty.",
    "Describe your favourite city.", "Give me three tips for learning Python.",
    "What is the capital of France? Explain its history.", "Write a short letter to a friend.",
    "List the planets of the solar system.", "Summarize the plot of Romeo and Juliet.",
]  # fmt: skip
SYSTEM = "You are a helpful assistant who answers briefly and precisely."
TOPICS = ["assert", "assignment", "atom-literals", "bltin-code-objects", "break", "class", "continue", "del", "for",
          "global"]  # fmt: skip
topics = pydoc_data.topics.topics
chats = [[{"role": "user", "content": p}] for p in SHORT] + [
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Summarize this documentation in two sentences:\n\n" + topics[t][:1200]}]
    for t in TOPICS
]  # fmt: skip
PRESSES = {
    "default": ("compresskv", {}),
    "default+value_norm": ("compresskv", {"novelty_value_norm": True}),
    "snapkv": ("snapkv", {}),  # kvpress's SnapKV needs more than its 64-token window: the document prompts only
    "streamingllm": ("streamingllm", {}),
}


def ids_of(chat):
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


@torch.no_grad()
def greedy(press, ids, steps=40):
    with press(model) if press is not None else torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False)
    return out[0, ids.shape[1]:]


def distinct3(tokens):
    grams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    return len(set(grams)) / max(len(grams), 1)


out = open(sys.argv[1] if len(sys.argv) > 1 else "results/frontier/chat/chat_prompts.jsonl", "w")
for i, chat in enumerate(chats):
    ids = ids_of(chat)
    answer = greedy(None, ids)[None]
    full_cache, _ = prefill(model, None, ids)
    full = continuation_logprobs(model, full_cache, ids.shape[1], answer)
    for ratio in (0.75, 0.5):
        for label, (method, options) in PRESSES.items():
            if method == "snapkv" and ids.shape[1] <= 64:
                continue
            press = make_press(method, ratio, **options)
            cache, _ = prefill(model, press, ids)
            logp = continuation_logprobs(model, cache, ids.shape[1], answer)
            kl = (full.exp() * (full - logp)).sum(-1).mean().item()
            own = greedy(press, ids).tolist()
            top1 = (logp.argmax(-1) == full.argmax(-1)).float().mean().item()
            text = tok.decode(own, skip_special_tokens=True)
            row = dict(prompt=i, kind="short" if i < len(SHORT) else "document", tokens=ids.shape[1], kept=1 - ratio,
                       press=label, kl=kl, top1=top1, new_tokens=len(own), distinct3=distinct3(own), text=text)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
