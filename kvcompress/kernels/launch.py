"""Host side of the weighted attention kernels (:mod:`kvcompress.kernels.weighted_decode`): the split heuristic,
launch plans cached per shape, the kernels' launch options per plan, and the reused split partials, so that a call
does no planning and no allocation beyond its output once its shape has been seen (a static cache's shape never
changes; a dynamic cache's grows by one row a step).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

MAX_BLOCK_ROWS = 128  # rows (= group * m) per program; more rows -> a third grid axis over row blocks
MIN_KEYS_PER_SPLIT = 256  # a split's partials (rows * (d_v + 2) fp32) stay <~ 10% of its K/V bytes
MAX_SPLITS = 256
SPLITS_PER_SM = 2  # target >= 2 programs per SM so that the loads of one hide the other's latency
DEFAULT_SM_COUNT = 132  # H100 SXM; used when the device cannot be asked (CPU interpreter runs)
REDUCE_CHUNK = 16  # splits merged per step in stage 2


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` is a constexpr function: about 4 us a host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``, without its constexpr wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def choose_num_splits(
    n: int, programs_per_split: int, block_n: int, sm_count: int = DEFAULT_SM_COUNT,
    min_keys: int = MIN_KEYS_PER_SPLIT,
) -> int:  # fmt: skip
    """Key-axis splits: enough programs for ``SPLITS_PER_SM * sm_count`` in total, but >= 256 keys per split.

    ``programs_per_split = batch * h_kv * row_blocks``. Long caches with few (batch, KV head) pairs get many
    splits (e.g. batch 1, 4 KV heads, n = 32k on 132 SMs: 66 splits of 512 keys); short caches or large
    batches get one split and skip stage 2.
    """
    tiles = cdiv(n, block_n)
    max_splits = min(MAX_SPLITS, cdiv(tiles, max(1, min_keys // block_n)))
    wanted = cdiv(SPLITS_PER_SM * sm_count, programs_per_split)
    return max(1, min(wanted, max_splits))


def whole_tile_splits(n: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """Keys per split, a whole number of ``block_n`` tiles, and the splits of ``n`` keys that leaves (no empty one)."""
    split_len = cdiv(cdiv(n, block_n), num_splits) * block_n
    return split_len, cdiv(n, split_len)


def dot_in_fp32(dtype: torch.dtype, interpret: bool) -> bool:
    """Whether a kernel upcasts its dot inputs to fp32: always for fp32 inputs, and for bf16 ones in the CPU
    interpreter, where tl.dot on bf16 is wrong (GPU runs keep 16-bit tensor-core dots)."""
    return dtype == torch.float32 or (interpret and dtype == torch.bfloat16)


class Tiles(NamedTuple):
    """What a launch plan derives from the shapes without the key count: cached per such shape, so a dynamic
    cache's call, one row longer every step, plans only its key splits."""

    rows: int  # query rows per (batch, KV head) pair: group x m
    row_blocks: int
    block_r: int
    block_n: int
    block_d: int
    block_dv: int
    num_warps: int
    dot_fp32: bool
    reduce_warps: int
    programs: int  # programs per key split: batch x h_kv x row_blocks
    sm_count: int


class LaunchPlan(NamedTuple):
    """Everything the launcher derives from shapes and options (cached per shape: no per-call planning)."""

    grid: tuple[int, int, int]
    n_read: int
    causal_offset: int
    split_len: int
    num_splits: int
    reduce_block_s: int
    tiles: Tiles


_PLANS: dict[tuple, LaunchPlan] = {}
_TILES: dict[tuple, Tiles] = {}
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_DUMMIES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_CACHE_LIMIT = 256  # distinct shapes kept (a dynamic cache changes n every step; a static one never)


def launch_plan(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    causal_offset: int | torch.Tensor | None,
    num_splits: int | None,
    block_n: int | None,
    block_r: int | None,
    interpret: bool = False,
) -> LaunchPlan:
    """The cached launch plan for these shapes (``causal_offset`` a tensor: read on device, all n rows planned;
    ``interpret``: the kernels run in Triton's CPU interpreter)."""
    on_device = isinstance(causal_offset, torch.Tensor)
    key = (queries.shape, keys.shape, values.shape[3], queries.dtype, queries.device,  # torch.Size hashes as a tuple
           "device" if on_device else causal_offset, num_splits, block_n, block_r, interpret)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    tiles_key = (queries.shape, keys.shape[1], keys.shape[3], values.shape[3], queries.dtype, queries.device,
                 block_n, block_r, interpret)  # fmt: skip
    tiles = _TILES.get(tiles_key)
    if tiles is None:
        if len(_TILES) >= _CACHE_LIMIT:
            _TILES.clear()
        tiles = _TILES[tiles_key] = plan_tiles(queries, keys.shape[1], values.shape[3], block_n, block_r, interpret)
    m, n = queries.shape[2], keys.shape[2]
    # Keys past causal_offset + m - 1 are invisible to every row: never read them (a device offset: plan all n,
    # the kernel still skips the invisible tiles).
    c = n if causal_offset is None or on_device else min(causal_offset, n)
    n_read = n if on_device else min(n, c + m)
    if num_splits is None:
        num_splits = choose_num_splits(n_read, tiles.programs, tiles.block_n, tiles.sm_count)
    split_len, num_splits = whole_tile_splits(n_read, num_splits, tiles.block_n)
    plan = LaunchPlan(
        grid=(tiles.programs // tiles.row_blocks, num_splits, tiles.row_blocks),
        n_read=n_read,
        causal_offset=c,
        split_len=split_len,
        num_splits=num_splits,
        reduce_block_s=min(REDUCE_CHUNK, next_power_of_2(num_splits)),
        tiles=tiles,
    )
    if len(_PLANS) >= _CACHE_LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def plan_tiles(
    queries: torch.Tensor, heads_kv: int, d_v: int, block_n: int | None, block_r: int | None, interpret: bool
) -> Tiles:
    """The tiles and warps for ``[b, h_q, m, d]`` queries over ``heads_kv`` KV heads with ``d_v`` value columns."""
    batch, heads_q, m, dim = queries.shape
    rows = heads_q // heads_kv * m
    block_d, block_dv = next_power_of_2(dim), next_power_of_2(d_v)
    wide = max(block_d, block_dv) > 128
    # float32 (FMA dots): 16 rows x 32 keys, 8 warps, the tiles that compile without register spills on sm_90 at
    # head dims 64-256 (the 16-bit tiles spilled 0.5-10 KB a thread in float32: eval.compile_kernels).
    fp32 = queries.dtype == torch.float32
    if block_r is None:
        widest = 16 if fp32 else MAX_BLOCK_ROWS // 2 if wide else MAX_BLOCK_ROWS
        block_r = min(max(16, next_power_of_2(rows)), widest)
    row_blocks = cdiv(rows, block_r)
    if block_n is None:
        block_n = 32 if wide or fp32 else 64
    return Tiles(
        rows=rows,
        row_blocks=row_blocks,
        block_r=block_r,
        block_n=block_n,
        block_d=block_d,
        block_dv=block_dv,
        num_warps=8 if fp32 or block_r * block_dv >= 128 * 128 else 4,
        dot_fp32=dot_in_fp32(queries.dtype, interpret),
        reduce_warps=4 if block_dv >= 256 else 2,
        programs=batch * heads_kv * row_blocks,
        sm_count=sm_count(queries.device),
    )


def workspace(
    device: torch.device, pairs: int, plan: LaunchPlan, d_v: int, reuse: bool = True
) -> tuple[torch.Tensor, ...]:
    """Stage-1 partials ``(m, den, acc)`` and the fused merge's counters (int32, one per pair and row block, zero
    between launches), reused across calls of one shape. Calls on one stream run in order, so a later call
    overwrites them only after stage 2 of the earlier one has read them. ``reuse=False``: new ones, not kept (a call
    that a CUDA graph records: see :func:`kvcompress.kernels.weighted_decode.weighted_decode_attention`)."""
    key = (device, pairs, plan.num_splits, plan.tiles.rows, d_v, plan.grid[2])
    space = _WORKSPACES.get(key) if reuse else None
    if space is None:
        rows = plan.tiles.rows
        mpart = torch.empty(pairs, plan.num_splits, rows, dtype=torch.float32, device=device)
        npart = torch.empty(pairs, plan.num_splits, rows, d_v, dtype=torch.float32, device=device)
        locks = torch.zeros(pairs * plan.grid[2], dtype=torch.int32, device=device)
        space = (mpart, torch.empty_like(mpart), npart, locks)
        if reuse:
            if len(_WORKSPACES) >= _CACHE_LIMIT:
                _WORKSPACES.clear()
            _WORKSPACES[key] = space
    return space


def dummies(device: torch.device, dtype: torch.dtype, reuse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholders for absent optional inputs (never read: their HAS_* flag is off); ``reuse=False``: new ones,
    not kept."""
    key = (device, dtype)
    if not reuse:
        return torch.zeros(1, 1, 1, dtype=dtype, device=device), torch.zeros(1, 1, dtype=torch.uint8, device=device)
    if key not in _DUMMIES:
        _DUMMIES[key] = dummies(device, dtype, reuse=False)
    return _DUMMIES[key]


def kernel_options(
    plan: LaunchPlan, dim: int, d_v: int, *, has_vmin: bool, has_vmax: bool, has_mask: bool,
    offset_on_device: bool, num_stages: int, fused_merge: bool = False, fold: bool = False,
    fold_on_device: bool = False,
) -> tuple[dict, dict]:  # fmt: skip
    """The constexprs and launch options of stage 1 and stage 2 (used when ``plan.num_splits > 1``) for a launch
    ``plan``: what the launcher passes, and what ``eval.compile_kernels`` compiles for a GPU without one. Cached per
    tiles and flags (a dynamic cache's plan is new every step, its options are not): never mutate the returned
    dicts."""
    return _options(plan.tiles, plan.num_splits == 1, plan.reduce_block_s, dim, d_v, has_vmin, has_vmax, has_mask,
                    offset_on_device, num_stages, fused_merge, fold, fold_on_device)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _options(
    tiles: Tiles, final: bool, reduce_block_s: int, dim: int, d_v: int, has_vmin: bool, has_vmax: bool,
    has_mask: bool, offset_on_device: bool, num_stages: int, fused_merge: bool, fold: bool, fold_on_device: bool,
) -> tuple[dict, dict]:  # fmt: skip
    clips = dict(HAS_VMIN=has_vmin, HAS_VMAX=has_vmax)
    split = dict(
        D=dim, DV=d_v, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, BLOCK_DV=tiles.block_dv,
        HAS_MASK=has_mask, FINAL=final, DOT_FP32=tiles.dot_fp32, OFFSET_PTR=offset_on_device,
        FUSED_MERGE=fused_merge and not final, num_warps=tiles.num_warps, num_stages=num_stages, FOLD=fold,
        FOLD_PTR=fold_on_device, **clips,
    )  # fmt: skip
    reduce = dict(DV=d_v, BLOCK_S=reduce_block_s, BLOCK_DV=tiles.block_dv, num_warps=tiles.reduce_warps,
                  HAS_MASK=has_mask, FOLD=fold, FOLD_PTR=fold_on_device, **clips)  # fmt: skip
    return split, reduce
