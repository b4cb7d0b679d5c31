"""The server's decode step over a :class:`~kvcompress.serve.batch.DecodeBatch`: eager, or compiled for static
batches (``torch.compile``; CUDA graphs on a GPU), and the warm-up that compiles every graph a server needs before
its first request."""

from __future__ import annotations

import collections
import threading

import torch
from transformers import DynamicCache

from kvcompress.serve.batch import DecodeBatch, build, mark_dynamic, session_rows

COMPILE_BACKENDS = ("auto", "off", "inductor", "cudagraphs", "eager")


def resolved_backend(model, backend: str) -> str:
    """``"auto"``: ``"inductor"`` for a model on one CUDA device (its steps are bound by their launches there: an
    H200 ran a 4-layer Qwen2.5-7B-shaped batch of 8 sessions' step in 0.38x the eager step's time), ``"off"``
    elsewhere (on CPU compiling gained 6-7% a step; a model split over devices is not captured); any other name as
    it is."""
    if backend != "auto":
        return backend
    split = len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1
    return "inductor" if model.device.type == "cuda" and not split else "off"


def compiled_forward(model, backend: str):
    """``model.forward`` compiled for decode steps over static batches (``build(..., static=True)``), or None for
    ``"off"``. One graph per step (``fullgraph=True``), the batch and capacity sizes symbolic: a batch of one and
    every larger batch take one graph each (:func:`warm_up` compiles both). ``"inductor"``: on CUDA with
    ``mode="reduce-overhead"`` (CUDA graphs, so a step is a few launches, not a few hundred); ``"cudagraphs"`` (CUDA
    only): CUDA graphs without inductor's code generation (compiles in seconds); ``"eager"``: the capture alone
    (checks; no speed-up); ``"auto"``: :func:`resolved_backend`."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile_decode: choose from {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
    backend = resolved_backend(model, backend)
    if backend == "off":
        return None
    if backend == "cudagraphs" and model.device.type != "cuda":
        raise ValueError(f"compile_decode: 'cudagraphs' needs the model on a CUDA device, got {model.device}")
    mode = "reduce-overhead" if backend == "inductor" and model.device.type == "cuda" else None
    return torch.compile(model.forward, fullgraph=True, backend=backend, mode=mode)


def cudagraph_state_for_this_thread() -> None:
    """Set up this thread's CUDA-graph-tree state if torch has not. Before torch 2.13 that state lives in thread-local
    storage stashed only in the thread that imported torch's inductor (pytorch/pytorch#123177), so a compiled step
    with CUDA graphs asserted in any other Python thread, such as the server's worker; torch 2.13 sets it up lazily,
    as this does, on inductor's own thread-local object. That object must hold the two containers: torch 2.11's stash
    keeps no reference of its own (2.13's does), so containers nothing else held were freed at once and the next
    graph read freed memory (on an H200: a SystemError in dict code, then a segmentation fault)."""
    if torch._C._is_key_in_tls("tree_manager_containers"):
        return
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


def warm_up(model, forward) -> None:
    """Compile ``forward`` (:func:`compiled_forward`) for every later static batch: one step of a batch of one session
    and one of two, each a single row from a one-token prefill with the model's own cache layers (sliding windows
    included, so these batches have the layers real sessions give). Dynamo specialises a batch of one; two and more
    share one graph with symbolic sizes, so later batches of any size and capacity compile nothing."""
    if model.device.type == "cuda":
        cudagraph_state_for_this_thread()  # the server calls this in its worker thread, where every step runs
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), past_key_values=cache,
          logits_to_keep=1)
    rows = session_rows(cache)
    for size in (1, 2):
        decode_step(model, build(None, [], [rows] * size, 2, static=True), [0] * size, [1] * size, forward)


def decode_step(model, batch: DecodeBatch, tokens: list[int], positions: list[int], forward=None) -> torch.Tensor:
    """One decode step of every session: ``tokens[b]`` at token position ``positions[b]``; logits ``[B, vocab]``
    (the model's dtype). Appends one row per session to ``batch``. One host-to-device copy (the step's tokens,
    positions and cache position), made before any kernel of the step is queued. ``forward``: what runs the model
    (default ``model`` itself; a compiled ``model.forward`` over a static batch)."""
    device = batch.layers[0].device
    counts = batch.row_counts()
    for each in counts:
        each.begin_step()
    first = batch.layers[0].counts
    width, size = first.width, len(tokens)
    step = torch.tensor([*tokens, *positions, width - 1], device=device)
    inputs = dict(input_ids=step[:size, None], position_ids=step[size : 2 * size, None],
                  attention_mask=first.visible[:, None, None, :],  # an sdpa-only layer's (weighted: key_mask)
                  cache_position=step[2 * size :])
    if forward is not None:  # copies, not views of ``step``: a view's storage offset (the batch size) would be
        for name in ("input_ids", "position_ids", "cache_position"):  # compiled in (``visible`` starts at 0)
            inputs[name] = inputs[name].clone()
        mark_dynamic(inputs["input_ids"], 0)
        mark_dynamic(inputs["position_ids"], 0)
        mark_dynamic(inputs["attention_mask"], 0, 3)
    try:
        out = (forward or model)(**inputs, past_key_values=batch, logits_to_keep=1, use_cache=True)
    except BaseException:
        for each in counts:
            each.end_step(appended=False)
        raise
    for each in counts:
        each.end_step()
    logits = out.logits[:, -1]
    return logits if forward is None else logits.clone()  # a CUDA graph's output is overwritten by its next replay
