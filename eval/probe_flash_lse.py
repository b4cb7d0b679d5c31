"""Can a repeat chunk's (or a whole prefill's) attention hand the mass its row log-sum-exp? (CUDA; a probe.)

The repeat settings' mass runs two passes of ``QK^T`` over the context (``kvcompress/kernels/attention_mass.py``);
with KVzip's normalisation (the pilots in docs/BENCHMARKS.md: no measurable change in answers or continuation) its
first pass, each repeat query's log-sum-exp over the context and its chunk, is what the chunk's own attention
already computes. torch's public ``scaled_dot_product_attention`` does not return it; its private flash operators
do, with their own layouts and limits. For one repeat chunk of the Qwen2.5-7B-Instruct head shape (28 query and 4 KV
heads, d = 128, bf16: ``--chunk`` queries after ``--context`` cached keys, lower-right causal), each candidate
operator is called as the press would call it (grouped heads, no expanded copy), and its output and log-sum-exp
are compared against the public sdpa and a float32 log-sum-exp, and timed (median of ``--repeats``, ms) beside the
public sdpa call the press makes now. ``--context 0``: a whole causal prefill of ``--chunk`` tokens instead, beside
the public sdpa call of a no-press prefill (``is_causal``), as the induction prior's prefill hands its log-sum-exp
over. The candidates: torch's flash operators, its cuDNN operator, and the library's own choice
(``kvcompress.hf_attention._fused_attention_with_lse``: the kernel sdpa picks); the backend sdpa picks is printed. A
candidate that raises is reported with its error. Prints a table; writes JSON with ``--output``.

Run from the repository root on a CUDA machine: ``python -m eval.probe_flash_lse [--context 32768 --chunk 2048]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.probe_flash_lse", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768, help="cached context keys (default 32768; 0: a prefill)")
    p.add_argument("--chunk", type=int, default=2048, help="repeat chunk queries (default 2048)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per candidate (default 10)")
    p.add_argument("--output", default=None, help="JSON file of the results")
    args = p.parse_args(argv)
    if args.context < 0 or args.chunk < 2 or args.repeats < 1:
        p.error(f"--context, --chunk, --repeats: must be >= 0, 2, 1, got {args.context}, {args.chunk}, {args.repeats}")
    if not torch.cuda.is_available():
        p.error("CUDA is not available: the flash operators it probes run on a GPU (run this on a GPU machine)")
    return args


def candidates() -> dict:
    """name -> fn(q, k, v, scale) returning (output [b, h_q, c, d], lse [b, h_q, c] natural log) for q
    ``[b, h_q, c, d]`` and k / v ``[b, h_kv, n + c, d]``, the queries the last c positions (lower-right causal)."""

    def sdpa_flash(q, k, v, scale):  # [b, h, s, d]; is_causal on q_len != k_len: the kernel's own alignment
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return out[0], out[1]

    def flash_forward(q, k, v, scale):  # [b, s, h, d], FlashAttention-2's bottom-right causal
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.shape[2], k.shape[2], 0.0, True,
            False, scale=scale,
        )  # fmt: skip
        return out[0].transpose(1, 2), out[1]

    def cudnn(q, k, v, scale):  # [b, h, s, d]; its causal alignment is checked by the comparison, not assumed
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return out[0], out[1].reshape(q.shape[:-1])

    def library(q, k, v, scale):  # a prefill only (as many keys as queries): it refuses a causal chunk
        from kvcompress.hf_attention import _fused_attention_with_lse

        return _fused_attention_with_lse(q, k, v, True, scale)

    return {
        "aten._scaled_dot_product_flash_attention": sdpa_flash,
        "aten._flash_attention_forward": flash_forward,
        "aten._scaled_dot_product_cudnn_attention": cudnn,
        "kvcompress _fused_attention_with_lse": library,
    }


def reference(q, k, v, scale, rows: int = 64):
    """The public sdpa output (lower-right causal, grouped heads) and the float32 log-sum-exp of the last ``rows``
    queries."""
    n = k.shape[2]
    out = public_sdpa(q, k, v, scale)
    group = q.shape[1] // k.shape[1]
    tail = q[:, :, -rows:].float()
    logits = scale * tail @ k.float().repeat_interleave(group, 1).transpose(-1, -2)  # [b, h_q, rows, n]
    hidden = torch.arange(n, device=q.device)[None, :] > (n - rows + torch.arange(rows, device=q.device))[:, None]
    return out, torch.logsumexp(logits.masked_fill(hidden, -torch.inf), -1)


def public_sdpa(q, k, v, scale):
    """The public sdpa call the model makes: ``is_causal`` for a prefill (as many keys as queries), else the
    lower-right mask of a repeat chunk."""
    from torch.nn.attention.bias import causal_lower_right

    c, n = q.shape[2], k.shape[2]
    mask = None if c == n else causal_lower_right(c, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=c == n, scale=scale, enable_gqa=True)


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    c, n = args.chunk, args.context + args.chunk
    q = torch.randn(1, 28, c, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 128**-0.5
    want_out, want_lse = reference(q, k, v, scale)
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, c == n, scale=scale, enable_gqa=True)
    print(f"sdpa picks: {torch.nn.attention.SDPBackend(choice).name} (is_causal={c == n}, no mask)")
    rows = {"public sdpa (now)": dict(ms=timed(lambda: public_sdpa(q, k, v, scale), args.repeats))}
    for name, fn in candidates().items():
        try:
            out, lse = fn(q, k, v, scale)
            rows[name] = dict(
                ms=timed(lambda fn=fn: fn(q, k, v, scale), args.repeats),
                output_max_diff=float((out.float() - want_out.float()).abs().max()),
                lse_max_diff=float((lse[..., -want_lse.shape[-1] :].float() - want_lse).abs().max()),
                lse_shape=list(lse.shape),
            )
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is a result
            rows[name] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300])
    print(f"{'candidate':45} {'ms':>8} {'output diff':>12} {'lse diff':>10}  note")
    for name, row in rows.items():
        print(
            f"{name:45} {row.get('ms', float('nan')):>8.3f} {row.get('output_max_diff', float('nan')):>12.2e} "
            f"{row.get('lse_max_diff', float('nan')):>10.2e}  {row.get('error', row.get('lse_shape', ''))}"
        )
    if args.output:
        info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, context=args.context, chunk=c)
        info["sdpa_picks"] = torch.nn.attention.SDPBackend(choice).name
        Path(args.output).write_text(json.dumps(dict(environment=info, rows=rows), indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
