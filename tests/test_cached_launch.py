"""kvcompress.kernels.cached_launch: its key against Triton's own binder, and its launches against ``kernel[grid]``.

No GPU needed: the binder is Triton's, built for a CUDA sm_90 target (it only reads the arguments), and the launches
are recorded by a JITFunction whose ``run`` (what ``kernel[grid](...)`` calls) stands in for Triton's. The launches
compiled on a GPU: ``test_kernel_weighted_decode.py``'s CUDA tests with ``CACHED_LAUNCH``.
"""

from __future__ import annotations

import random

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kvcompress.kernels import cached_launch, weighted_decode  # noqa: E402
from kvcompress.kernels.cached_launch import CachedLaunch, specialization_key  # noqa: E402


def jit_of(kernel) -> JITFunction:
    """The compiled-path JITFunction of one of our kernels (under the interpreter they are InterpretedFunctions)."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


SPLIT = jit_of(weighted_decode._weighted_split_kernel)
REDUCE = jit_of(weighted_decode._weighted_decode_reduce_kernel)
INTS = (0, 1, 2, 3, 15, 16, 17, 31, 32, 48, 4096, 32767, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40,
        2**63 - 1, 2**63 + 16, -1, -16, -(2**31) - 1)  # fmt: skip
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int32)


def binder_of(kernel: JITFunction):
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def constexpr_options(kernel: JITFunction, rng: random.Random) -> dict:
    return {p.name: rng.choice((16, 32, True, False)) for p in kernel.params if p.is_constexpr}


def random_arg(param, rng: random.Random):
    """A pointer (a tensor of a random dtype, 16-byte aligned or not), an int or a float, as the parameter takes."""
    if param.name.endswith("_ptr"):
        dtype = rng.choice(DTYPES)
        base = torch.empty(64, dtype=dtype)
        return base[rng.choice((0, 0, 1, 3)) :]  # a storage offset of 1 or 3 elements: not 16-byte aligned
    if param.name in ("qk_scale",):
        return rng.uniform(-2.0, 2.0)
    return rng.choice(INTS)


def same_class(x, rng: random.Random):
    """Another argument with ``x``'s key: a fresh tensor of the same dtype and alignment, or an int of its class."""
    if isinstance(x, torch.Tensor):
        base = torch.empty(64, dtype=x.dtype)
        if x.data_ptr() % 16 == 0:
            return base
        offset = next(o for o in range(1, 16) if (base.data_ptr() + o * x.element_size()) % 16)
        return base[offset:]
    if isinstance(x, float):
        return rng.uniform(-2.0, 2.0)
    return rng.choice([y for y in INTS if specialization_key((y,)) == specialization_key((x,))])


@pytest.mark.parametrize("kernel", [SPLIT, REDUCE], ids=["split", "reduce"])
def test_equal_keys_mean_equal_triton_specializations(kernel):
    """For random arguments A: B = A with every argument redrawn within its key class, C = A with one argument redrawn
    at random. Equal keys must mean equal specializations (Triton's binder), so one compiled kernel serves both."""
    rng = random.Random(0)
    binder = binder_of(kernel)
    positional = [p for p in kernel.params if not p.is_constexpr]
    differed = 0
    for _ in range(300):
        options = constexpr_options(kernel, rng)
        a = tuple(random_arg(p, rng) for p in positional)
        b = tuple(same_class(x, rng) for x in a)
        i = rng.randrange(len(a))
        c = a[:i] + (random_arg(positional[i], rng),) + a[i + 1 :]
        spec_a = binder(*a, **options)[1]
        assert specialization_key(b) == specialization_key(a)
        assert binder(*b, **options)[1] == spec_a
        if specialization_key(c) == specialization_key(a):
            assert binder(*c, **options)[1] == spec_a
        else:
            differed += 1
    assert differed > 30  # the redraws did change keys: the test saw both cases


class RecordingJIT(JITFunction):
    """A JITFunction whose launches are recorded: ``run`` returns a compiled-kernel stand-in that records its own."""

    def __init__(self, kernel: JITFunction):
        super().__init__(kernel.fn)
        self.calls: list[tuple] = []

    def run(self, *args, grid, warmup, **kwargs):
        self.calls.append(("triton", grid, args, kwargs))
        recorder = self

        class Compiled:  # like triton's CompiledKernel: its launcher reads grid[0], grid[1] and grid[2]
            def __getitem__(self, launch_grid):
                axes = (launch_grid[0], launch_grid[1], launch_grid[2])
                return lambda *all_args: recorder.calls.append(("compiled", axes, all_args))

        return Compiled()


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def split_call(rng: random.Random):
    positional = [p for p in SPLIT.params if not p.is_constexpr]
    args = tuple(random_arg(p, rng) for p in positional)
    options = {**constexpr_options(SPLIT, rng), "num_warps": 4, "num_stages": 2}
    return args, options


def test_a_seen_key_launches_the_compiled_kernel_with_tritons_arguments(one_gpu):
    """The first call goes through ``kernel[grid]``; the second, with other arguments of the same key, launches the
    kernel Triton returned with exactly the arguments Triton's own launch passes (its binder's bound values)."""
    rng = random.Random(1)
    kernel = RecordingJIT(SPLIT)
    launcher = CachedLaunch(kernel)
    args, options = split_call(rng)
    launcher((4, 32, 1), args, options)
    assert kernel.calls == [("triton", (4, 32, 1), args, options)]
    again = tuple(same_class(x, rng) for x in args)
    launcher((4, 7, 1), again, options)
    kind, grid, passed = kernel.calls[-1]
    assert (kind, grid) == ("compiled", (4, 7, 1))
    constexprs = {k: v for k, v in options.items() if k not in ("num_warps", "num_stages")}
    bound = binder_of(SPLIT)(*again, **constexprs)[0]
    assert len(passed) == len(bound) and all(x is y for x, y in zip(passed, bound.values(), strict=True))


def test_a_one_axis_grid_reaches_the_compiled_launcher_with_three(one_gpu):
    """The reduce kernel's grid has one axis; Triton's compiled launcher reads three (``kernel[grid]`` pads them)."""
    rng = random.Random(3)
    kernel = RecordingJIT(REDUCE)
    launcher = CachedLaunch(kernel)
    args = tuple(random_arg(p, rng) for p in REDUCE.params if not p.is_constexpr)
    options = {**constexpr_options(REDUCE, rng), "num_warps": 2}
    launcher((12,), args, options)
    launcher((12,), args, options)
    assert kernel.calls[-1][:2] == ("compiled", (12, 1, 1))


def test_a_new_key_goes_through_triton_again(one_gpu):
    """A misaligned pointer, an int of another class, other options or another device: Triton's path again."""
    rng = random.Random(2)
    kernel = RecordingJIT(SPLIT)
    launcher = CachedLaunch(kernel)
    args, options = split_call(rng)
    aligned = torch.empty(64, dtype=args[0].dtype)
    args = (aligned,) + args[1:]
    launcher((1,), args, options)
    n = [p.name for p in SPLIT.params].index("N")
    changes = [
        (aligned[1:],) + args[1:],  # q_ptr 4 or 2 bytes past a 16-byte boundary
        args[:n] + (1 if args[n] != 1 else 2,) + args[n + 1 :],
        args[:n] + (2**31 + 16,) + args[n + 1 :],
    ]
    for changed in changes:
        launcher((1,), changed, options)
        assert kernel.calls[-1][0] == "triton"
        launcher((1,), changed, options)
        assert kernel.calls[-1][0] == "compiled"
    launcher((1,), args, {**options, "num_warps": 8})
    assert kernel.calls[-1][0] == "triton"
    torch.cuda.current_device = lambda: 1  # restored by the fixture's monkeypatch
    launcher((1,), args, options)
    assert kernel.calls[-1][0] == "triton"


def test_interpreted_kernels_and_uncached_launches_pass_through(one_gpu):
    calls = []

    class Stub:  # an interpreted kernel, or eval.speed's skipped launch: not a JITFunction
        def __getitem__(self, grid):
            return lambda *args, **options: calls.append((grid, args, options))

    stub = Stub()
    for cached in (True, True, False):
        cached_launch.launch(stub, (2,), (1, 2.0), {"BLOCK": 16}, cached=cached)
    assert calls == [((2,), (1, 2.0), {"BLOCK": 16})] * 3


def test_misuse_is_refused(one_gpu):
    launcher = CachedLaunch(RecordingJIT(SPLIT))
    with pytest.raises(TypeError, match="positional arguments expected"):
        launcher((1,), (torch.empty(4),), {})

    def late(x_ptr, BLOCK: triton.language.constexpr, n):  # noqa: N803  (Triton's constexpr naming)
        pass

    with pytest.raises(ValueError, match="constexpr parameter after"):
        CachedLaunch(JITFunction(late))
