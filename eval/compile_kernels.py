"""Compile every Triton kernel of the library for a GPU without one: the prefill's (the fit's,
``kvcompress.kernels.fit_products``; the attention mass's, ``kvcompress.kernels.attention_mass``; the paper's RPNys
coreset, ``kvcompress.kernels.rpnys``) and the weighted attention's over a compressed cache (decode and many new
tokens, ``kvcompress.kernels.weighted_decode`` / ``weighted_prefill``: stage 1 and the split merge), with the
launch options their launchers choose, for each dtype, head dim and bin size asked, down to a cubin with the
ptxas bundled in the triton wheel. Prints each kernel's
shared memory and, where the wheel bundles ``cuobjdump``, its registers and stack and local (spilled) memory; exits
1 if a kernel fails to compile or needs more shared memory than the target has (spills are reported, not failed:
the attention mass's column pass spills 16 B in bf16 and ran at 187 TFLOP/s on an H200).

What it checks that the CPU interpreter cannot: the kernels type-check and lower for the target (tensor-core dot
shapes and precisions, shared memory within the target's limit, register spills). What it cannot: results or
speed (those need the GPU: the kernel tests compiled, ``python -m eval.bench_fit --backends torch triton``).

Run from the repository root without ``TRITON_INTERPRET=1``: ``python -m eval.compile_kernels [--arch 90]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory a block may use (A100, H100 / H200)


FLOAT_SCALARS = ("qk_scale", "beta_hi", "beta_lo", "rho_hi", "rho_lo")  # Python floats the launchers pass


def _signature(kernel, constexprs: dict, pointers: dict[str, str]) -> dict[str, str]:
    """Argument types of ``kernel``: constexprs by name, pointers as given, strides (``s_*``) int64, the float
    scalars fp32, other scalars int32 (what the launcher passes)."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in pointers:
            types[name] = pointers[name]
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i64" if name.startswith("s_") else "i32"
    return types


def compile_one(kernel, config: dict, pointers: dict[str, str], arch: int):
    """One kernel compiled for ``sm_<arch>`` with a launcher's ``config`` (constexprs, num_warps, num_stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {key: config[key] for key in ("num_warps", "num_stages") if key in config}  # else Triton's defaults
    constexprs = {key: value for key, value in config.items() if key not in options}
    source = ASTSource(
        fn=kernel,
        signature=_signature(kernel, constexprs, pointers),
        constexprs={(kernel.arg_names.index(name),): value for name, value in constexprs.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resource_usage(compiled) -> dict[str, int] | None:
    """Registers, stack and local memory (bytes; spilled registers live there) of a compiled kernel from the wheel's
    ``cuobjdump``, or None without it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {key.lower(): int(value) for key, value in found.items()} if found else None


def fit_cases(dtypes: list[str], head_dims: list[int], bin_rows: list[int]):
    """(name, kernel, launch config, pointer types) of every fit kernel configuration asked."""
    from kvcompress.fit_equations import fused_block
    from kvcompress.kernels import fit_products as fp

    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        data = "*" + dtype_name
        for dim in head_dims:
            for has_pos in (True, False):
                config = fp.rows_config(dim, dim, dtype, has_pos)
                pointers = dict(q_ptr=data, k_ptr=data, v_ptr=data, pos_ptr="*i64", lse_ptr="*fp32", out_ptr="*fp32")
                yield (
                    f"attention_rows {dtype_name} d={dim} positions={has_pos}",
                    fp._attention_rows_kernel,
                    config,
                    pointers,
                )
            for k in bin_rows:
                span, width = fused_block(k)
                config = fp.products_config(dim, span, width, dtype, True)
                pointers = dict(q_ptr=data, k_ptr=data, v_ptr=data, pos_ptr="*i64", lse_ptr="*fp32", a_ptr="*fp32",
                                low_ptr="*i64", owner_ptr="*i64", mass_ptr="*fp32", vals_ptr="*fp32")  # fmt: skip
                yield f"block_sums {dtype_name} d={dim} bin_rows={k}", fp._block_sums_kernel, config, pointers


def mass_cases(dtypes: list[str], head_dims: list[int]):
    """(name, kernel, launch config, pointer types) of the attention mass's two passes (causal, no key mask; the
    column pass summed and maxed)."""
    from kvcompress.kernels import attention_mass as am

    for dtype_name in dtypes:
        data = "*" + dtype_name
        pointers = dict(q_ptr=data, k_ptr=data, pos_ptr="*i64", mask_ptr="*u8", lse_ptr="*fp32", out_ptr="*fp32")
        for dim in head_dims:
            for reduce in ("sum", "max"):
                rows_pass, column_pass = am.launch_config(dim, DTYPES[dtype_name], True, False, reduce)
                if reduce == "sum":
                    yield f"mass rows {dtype_name} d={dim}", am._row_lse_kernel, rows_pass, pointers
                yield f"mass columns {dtype_name} d={dim} {reduce}", am._column_kernel, column_pass, pointers


def rpnys_cases(dtypes: list[str], head_dims: list[int]):
    """(name, kernel, launch config, pointer types) of the RPNys coreset kernel with the paper's 12 pivots a bin:
    bins of 48 rows (a 32k context kept at 25%), with and without a query radius, and the longest bin the kernel
    takes at that head dim (``rpnys.unsupported``: 256 rows, 128 at head dim 256)."""
    import triton

    from kvcompress.kernels import rpnys

    for dtype_name in dtypes:
        data = "*" + dtype_name
        for dim in head_dims:
            longest = min(rpnys.MAX_BIN_LENGTH, rpnys.MAX_TILE // max(16, triton.next_power_of_2(dim)))
            for length, has_radius in ((48, False), (48, True), (longest, False)):
                config = rpnys.launch_options(length * 64, dim, dim, 12 * 64, 64, has_radius)
                radius = "*fp64" if has_radius else "*fp32"  # the mean stands in for an absent radius
                pointers = dict(k_ptr=data, v_ptr=data, mean_ptr="*fp32", qr_ptr=radius, ks_ptr=data, vs_ptr=data,
                                w_ptr="*fp32")  # fmt: skip
                name = f"rpnys {dtype_name} d={dim} bin={length} radius={has_radius}"
                yield name, rpnys._rpnys_bins_kernel, config, pointers


def attention_cases(dtypes: list[str], head_dims: list[int]):
    """(name, kernel, launch config, pointer types) of the weighted attention over a compressed cache, as its
    launchers plan it for a Qwen2.5-7B-shaped layer (28 query heads, 4 KV heads) over 32,768 cached rows: a decode
    step (split over the keys: stage 1 and the merge), plain, with the merge fused into stage 1's last split, folding
    the step's row into the clip range (a dynamic cache's step, both ways; the server's decode batch, each row's own
    row and causal offset read on the device, no key mask), and as a static cache runs it (the causal offset read on
    the device, a key mask, the value clip), and a 512-token prefill chunk."""
    import torch

    from kvcompress.kernels import weighted_decode as wd
    from kvcompress.kernels.launch import launch_plan
    from kvcompress.kernels.weighted_prefill import pipeline_stages

    n = 32768
    for dtype_name in dtypes:
        dtype, data = DTYPES[dtype_name], "*" + dtype_name
        for dim in head_dims:
            cases = (("decode", 1, False, False, False), ("decode fused merge", 1, False, True, False),
                     ("decode folding", 1, False, False, True), ("decode fused merge folding", 1, False, True, True),
                     ("decode batch folding", 1, False, False, "rows"), ("decode static", 1, True, False, False),
                     ("prefill m=512", 512, False, False, False))  # fmt: skip
            for label, m, static, fused, fold in cases:
                queries = torch.empty(1, 28, m, dim, dtype=dtype, device="meta")
                keys = torch.empty(1, 4, n + m, dim, dtype=dtype, device="meta")
                on_device = static or fold == "rows"  # a decode batch: each row's offset, read on the device
                offset = torch.empty(1, dtype=torch.int64, device="meta") if on_device else n
                plan = launch_plan(queries, keys, keys, offset, None, None, None, interpret=False)
                stages = pipeline_stages(dim, dim, dtype) if m > wd.MAX_NEW_TOKENS else 2
                split, merge = wd.kernel_options(
                    plan, dim, dim, has_vmin=static or bool(fold), has_vmax=static or bool(fold),
                    has_mask=static, offset_on_device=on_device, num_stages=stages, fused_merge=fused,
                    fold=bool(fold), fold_on_device=fold == "rows",
                )  # fmt: skip
                partial = data if plan.num_splits == 1 else "*fp32"  # one split: stage 1 writes the output
                pointers = dict(q_ptr=data, k_ptr=data, v_ptr=data, w_ptr=data, vmin_ptr=data, vmax_ptr=data,
                                mask_ptr="*u8", out_ptr=data, mpart_ptr=partial, dpart_ptr=partial,
                                npart_ptr=partial, offset_ptr="*i64" if on_device else "*u8",
                                lock_ptr="*i32" if fused else "*u8",
                                fold_ptr="*i64" if fold == "rows" else "*u8")  # fmt: skip
                name = f"weighted {label} {dtype_name} d={dim}"
                yield f"{name} splits={plan.num_splits}", wd._weighted_split_kernel, split, pointers
                if plan.num_splits > 1 and not fused:
                    merged = dict(pointers, mpart_ptr="*fp32", dpart_ptr="*fp32", npart_ptr="*fp32")
                    yield f"{name} merge", wd._weighted_decode_reduce_kernel, merge, merged


FAMILIES = {"fit": fit_cases, "mass": mass_cases, "rpnys": rpnys_cases, "attention": attention_cases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.compile_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, choices=sorted(MAX_SHARED), default=90, help="compute capability x 10")
    p.add_argument("--kernels", nargs="+", choices=list(FAMILIES), default=list(FAMILIES), help="kernel families")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256], help="each in [1, 256]")
    p.add_argument("--bin-rows", type=int, nargs="+", default=[1, 16, 64], help="fit bin sizes, each in [1, 64]")
    args = p.parse_args(argv)
    if any(not 1 <= d <= 256 for d in args.head_dims):
        p.error(f"--head-dims: each must be in [1, 256], got {args.head_dims}")
    if any(not 1 <= k <= 64 for k in args.bin_rows):
        p.error(f"--bin-rows: each must be in [1, 64], got {args.bin_rows}")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        p.error("TRITON_INTERPRET=1 is set: the kernels would be defined for the interpreter; unset it")
    failed = 0
    cases = []
    for family in args.kernels:
        sizes = (args.head_dims, args.bin_rows) if family == "fit" else (args.head_dims,)
        cases += FAMILIES[family](args.dtypes, *sizes)
    for name, kernel, config, pointers in cases:
        try:
            compiled = compile_one(kernel, config, pointers, args.arch)
        except Exception as exc:  # noqa: BLE001 - report every configuration's failure, then exit 1
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            failed += 1
            continue
        shared = compiled.metadata.shared
        usage = resource_usage(compiled)
        spilled = 0 if usage is None else usage.get("local", 0) + usage.get("stack", 0)
        too_big = shared > MAX_SHARED[args.arch]
        failed += too_big
        print(
            f"{'FAILED' if too_big else 'ok':6} {name}: warps {config['num_warps']}, shared {shared} B"
            + ("" if usage is None else f", registers {usage.get('reg')}, stack + local {spilled} B")
        )
    print(f"{failed} failed for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
