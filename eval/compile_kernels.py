"""Compile the prefill's Triton kernels (the fit's, ``kvcompress.kernels.fit_products``, and the attention mass's,
``kvcompress.kernels.attention_mass``) for a GPU without one: the launch options their launchers choose, for each
dtype, head dim and bin size asked, down to a cubin with the ptxas bundled in the triton wheel. Prints each kernel's
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


def _signature(kernel, constexprs: dict, pointers: dict[str, str]) -> dict[str, str]:
    """Argument types of ``kernel``: constexprs by name, pointers as given, strides (``s_*``) int64, ``qk_scale``
    fp32, other scalars int32 (what the launcher passes)."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in pointers:
            types[name] = pointers[name]
        else:
            types[name] = "fp32" if name == "qk_scale" else "i64" if name.startswith("s_") else "i32"
    return types


def compile_one(kernel, config: dict, pointers: dict[str, str], arch: int):
    """One kernel compiled for ``sm_<arch>`` with a launcher's ``config`` (constexprs, num_warps, num_stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {key: config[key] for key in ("num_warps", "num_stages")}
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
                pointers = dict(q_ptr=data, k_ptr=data, pos_ptr="*i64", lse_ptr="*fp32", a_ptr="*fp32",
                                low_ptr="*i64", c_ptr="*fp32")  # fmt: skip
                yield f"block_products {dtype_name} d={dim} bin_rows={k}", fp._block_products_kernel, config, pointers


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.compile_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, choices=sorted(MAX_SHARED), default=90, help="compute capability x 10")
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
    cases = [*fit_cases(args.dtypes, args.head_dims, args.bin_rows), *mass_cases(args.dtypes, args.head_dims)]
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
