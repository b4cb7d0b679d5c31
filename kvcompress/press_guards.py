"""What a kvcompress press refuses, and when: each check runs before anything is written to the cache.

A press stores per-row weights with the cache, so it runs alone (not nested, composed or wrapped), on the model
families whose attention it replaces, over token ids when it reads the context twice, and never leaves a layer
compressed from NaN or Inf keys without saying so.
"""

from __future__ import annotations

import sys

import torch
from kvpress.presses.base_press import BasePress
from transformers import (
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from kvcompress.padding import SLIDING_PADDED_REPEAT

SUPPORTED_MODELS = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Phi3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)


def check_supported_model(press: BasePress, model: PreTrainedModel) -> None:
    if not isinstance(model, SUPPORTED_MODELS):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_MODELS)
        raise ValueError(f"model: {type(model).__name__} is not supported by {type(press).__name__}; use {names}")


def refuse_a_wrapper(press: BasePress, caller: object) -> None:
    """Raise when ``caller`` (whoever called ``press.post_init_from_model``) is another press: a wrapper
    (ComposedPress, PrefillDecodingPress, ...) would evict rows after ours and misalign their weights. Inside the
    press's own ``with`` block, or from user code (kvpress's idiom), the call is fine."""
    if not press._entered and isinstance(caller, BasePress) and caller is not press:
        raise ValueError(
            f"press: {type(press).__name__} cannot run inside {type(caller).__name__}: it stores per-row weights with "
            "the cache, and a press that evicts rows after it would misalign them. Use it on its own: "
            f"with {type(press).__name__}(...)(model): ..."
        )


def refuse_a_second_press(press: BasePress, model: PreTrainedModel) -> None:
    """Raise if ``press`` is already applied, or another kvpress press is applied to ``model``: two presses would
    each compress the other's output (a wrong token count, or rows that no longer match their weights)."""
    if press._entered:
        raise ValueError(
            f"press: this {type(press).__name__} is already applied (its `with press(model)` block is open); apply "
            "it once, e.g. not both `with press(model):` and `pipe(..., press=press)`"
        )
    refuse_other_presses(press, model)


def refuse_other_presses(press: BasePress, model: torch.nn.Module) -> None:
    """Raise if a kvpress press other than ``press`` has hooks on ``model`` (or a decoder of it): at ``with
    press(model)``, one entered before; before each prefill, one entered inside ``press``'s block."""
    for module in model.modules():
        for hook in getattr(module, "_forward_hooks", {}).values():
            other = getattr(hook, "__self__", None)
            if isinstance(other, BasePress) and other is not press:
                raise ValueError(
                    f"press: {type(other).__name__} is already applied to this model; {type(press).__name__} runs "
                    "alone (leave the other press's `with` block first)"
                )


def refuse_an_assisted_prefill(press: BasePress) -> None:
    """Raise if this prefill runs inside transformers' assisted decoding (``assistant_model`` or
    ``prompt_lookup_num_tokens`` under ``with press(model)``): its first forward carries the drafted tokens with
    the prompt, which the press would compress as context (different tokens than greedy decoding, or a crop into
    the compressed context when drafts are rejected)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_assisted_decoding" and "transformers" in code.co_filename:
            raise ValueError(
                f"press: {type(press).__name__} under assisted decoding (assistant_model, prompt_lookup_num_tokens) "
                "would compress the drafted tokens with the prompt; compress the prompt first (one forward under "
                "`with press(model)`), then generate with that cache (README, Usage)"
            )
        frame = frame.f_back


def refuse_a_repeat_pass(
    press: BasePress, input_ids: torch.Tensor | None, cache, padded: bool, windows: list[int | None],
    images: bool = False,
) -> None:  # fmt: skip
    """Raise, before the prefill, for a repeat pass (``reference`` with ``"repeat"``) this call cannot run: without
    token ids (``inputs_embeds``), over image features (``images``: a multimodal model's ``pixel_values``), or over a
    padded batch with sliding-window layers (``windows``: the model's window per layer, None where a layer sees every
    token)."""
    if images:
        raise ValueError(
            f"pixel_values: {type(press).__name__} with reference 'repeat' reads the context's token ids a second "
            "time, and they do not carry this call's images; drop 'repeat' from reference (the default press has "
            "none) for a context with images"
        )
    if input_ids is None:
        raise ValueError(
            f"input_ids: {type(press).__name__} with reference 'repeat' reads the context's token ids a second "
            "time; call the model with input_ids (not inputs_embeds), or drop 'repeat' from reference"
        )
    layers = cache.layers if cache is not None else []
    sliding = any(getattr(layer, "is_sliding", False) for layer in layers) or (
        cache is None and any(window is not None for window in windows)
    )
    if padded and sliding:
        raise ValueError(SLIDING_PADDED_REPEAT)


def refuse_non_finite_layers(
    flags: list[tuple[int, tuple[str, ...], torch.Tensor]], dtype: torch.dtype | None = None
) -> None:
    """Raise if a compressed layer's keys or values held NaN or Inf. ``flags``: ``(layer index, names, bool per
    name)``, each one's tensors finite: the prefill's ``("keys", "values")`` and, once compressed, its
    ``("compressed values",)`` (values and weights), read all at once after the prefill (one host-device sync)."""
    if not flags:
        return
    finite = torch.cat([flag for _, _, flag in flags]).cpu().tolist()
    labels = [(layer_idx, name) for layer_idx, names, _ in flags for name in names]
    for (layer_idx, name), ok in zip(labels, finite, strict=True):
        if ok:
            continue
        if name == "compressed values":
            raise ValueError(
                f"layer {layer_idx} {name}: NaN or Inf after compression: the weighted values (w v) outgrew "
                f"{dtype or 'the cache dtype'}; run the model in bfloat16 or float32 (the cache passed in holds "
                "no token of this prefill, as before the call)"
            )
        raise ValueError(
            f"layer {layer_idx} {name}: contains NaN or Inf (the model's own prefill produced them; the "
            "cache passed in holds no token of this prefill, as before the call)"
        )


class LayerChoiceError(ValueError):
    """A per-layer option naming layers the model cannot give it; ``from_calibration``: the layers at fault came from
    the model's calibration (``"auto"``), not from the caller."""

    def __init__(self, message: str, from_calibration: bool):
        super().__init__(message)
        self.from_calibration = from_calibration


def check_layer_options(windows: list[int | None], options: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Per-layer options (``(name, layers, where they came from)``: ``""``, or `` (from the calibration of M)``)
    against the model's layers (``windows``: None for a full-attention layer): each layer a full-attention one, none
    named by two options, and at least one full-attention layer named by none (the unnamed layers give up the rows the
    named ones gain). :class:`LayerChoiceError` otherwise."""
    full = [index for index, window in enumerate(windows) if window is None]
    contiguous = len(full) > 1 and full == list(range(full[0], full[-1] + 1))
    accepted = f"{full[0]} to {full[-1]}" if contiguous else ", ".join(map(str, full)) or "none"
    seen: dict[int, str] = {}
    for name, layers, origin in options:
        for layer in layers:
            if layer not in full:
                raise LayerChoiceError(
                    f"{name}: {layer}{origin} is not a full-attention layer of this {len(windows)}-layer model; "
                    f"accepted: {accepted}", bool(origin)
                )  # fmt: skip
            if layer in seen:
                raise LayerChoiceError(
                    f"{name}: {layer}{origin} is also in {seen[layer]}: name each layer in one of them", bool(origin)
                )
            seen[layer] = name + origin
    named = [(name, layers, origin) for name, layers, origin in options if layers]
    if named and len(seen) == len(full):
        (name, layers, origin), others = named[0], named[1:]
        also = "".join(f" with {other} {other_layers!r}{other_origin}" for other, other_layers, other_origin in others)
        raise LayerChoiceError(
            f"{name}: {layers!r}{origin}{also} names every full-attention layer, so none is left to give up rows: name "
            "fewer (or change compression_ratio instead)", bool(origin)
        )  # fmt: skip
