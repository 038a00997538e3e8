"""Tile sizes and launch shape of the cascade kernels, chosen per (GQA ratio, head_dim).

``KernelConfig`` is the compile-time shape of the prefix / suffix / merge launches (plus the
planner's wave targets). ``tile_config(ratio, head_dim)`` is the one place that picks it for a
model's head shape: the prefix tile packs ``block_m`` flat (request, q-head) rows whatever the
ratio (work_list.py), so every GQA ratio fills its MMA rows; what is left to choose per shape is
in ``SHAPE_TILES``.
"""

from dataclasses import dataclass, replace
from typing import Any, Dict, Literal, Tuple, Union, get_args

import torch

__all__ = ["KernelConfig", "SHAPE_TILES", "FP8_KV_DTYPES", "PREFIX_KERNELS", "tile_config", "device_config",
           "default_config"]

PREFIX_SOFTMAX_MODES = ("scaled", "fma", "lazy")
"""``KernelConfig.prefix_softmax`` values, in the order of the prefix kernels' ``SOFTMAX`` codes."""

PrefixKernel = Literal["pointer", "descriptor", "wgmma", "auto"]
PREFIX_KERNELS = get_args(PrefixKernel)
"""``KernelConfig.prefix_kernel`` values (``--granikv-prefix-kernel`` offers the same)."""

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 caches the kernels read as stored (SGLang's ``--kv-cache-dtype fp8_e4m3`` /
``fp8_e5m2``), widened in registers (``KernelConfig.fp8_math``)."""


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of the cascade kernels (all compile-time except the waves)."""

    block_m: int = 64
    """Prefix rows per tile (q-heads x requests stacked as flat rows, work_list.py: every tile of
    a group full but its last, whatever the GQA ratio)."""
    block_n: int = 64
    """Prefix keys per inner step (64 measured fastest on H200 with block_m 64, although ptxas
    reports a ~1 KB stack there; 32 has no spill but was 1.3x slower, docs/results/kernels.md)."""
    prefix_warps: int = 4
    prefix_stages: int = 3
    suffix_block_n: int = 32
    """Suffix keys (gathered slots) per inner step."""
    suffix_warps: int = 4
    suffix_stages: int = 2
    prefix_waves: float = 1.5
    """Prefix launch aims at prefix_waves * sm_count programs (1.5 with overlap_suffix: the SMs
    the prefix leaves run suffix programs; 2.0 was best without overlap, docs/results/kernels.md)."""
    suffix_waves: float = 4.0
    """Suffix launch aims at suffix_waves * sm_count programs."""
    min_prefix_chunk: int = 256
    """Smallest kv chunk of a prefix item (bounds the partial-state traffic)."""
    min_suffix_chunk: int = 64
    even_split: bool = True
    """Prefix inner loop: unmasked full tiles + a masked tail (True) or every tile masked (False).
    Sweep 8 (H200, serving-size grids): prefix alone 59.4 -> 56.5 us at 16K x 64, 106.5 -> 100.3
    at 16K x 128; cascade equal at 64, 121.3 -> 118.8 at 128 (docs/results/kernels.md)."""
    overlap_suffix: bool = True
    """Run the suffix launch on a side CUDA stream, concurrently with the prefix launch (they
    write disjoint partial rows; the merge waits for both). Tensor-core-bound prefix tiles and
    latency-bound suffix gathers then share the SMs instead of running back to back. Captured
    into CUDA graphs as a fork/join. No effect on CPU."""
    suffix_priority: bool = False
    """With ``overlap_suffix``: the side stream the suffix launch runs on has CUDA's highest
    stream priority (captured into CUDA graphs as its kernel nodes' priority), so that as SMs
    free up the block scheduler places the suffix launch's programs before the prefix launch's
    remaining ones. The prefix launch alone is faster at more waves (on an H100, 1.75 waves:
    480 TFLOP/s at 16K x 128 against 403 at 1.5), but the layer was 6-11% slower there, its
    suffix launch waiting for SMs (docs/results/kernels.md, "The SM split"). Off: measured
    slower with every prefix wave target tried (sweep variants ``sfx_prio*``; kernels.md, "The
    suffix launch first or at the highest stream priority")."""
    suffix_first: bool = False
    """With ``overlap_suffix``: the suffix launch is issued before the prefix launch (each on
    its stream, as before), so its programs take SMs first and the prefix launch's fill the
    rest. Same work and outputs, in another order of launch. Off: measured slower or equal
    (sweep variants ``sfx_first``, ``sfx_prio_first*``; kernels.md, same section)."""
    reuse_chunk_factor: float = 1.5
    """``fill`` reuses the previous step's work list, with each request's last suffix chunk
    extended to its new ``seq_len``, while the grouping (hence the prefix items) is unchanged and
    every last suffix chunk stays within ``reuse_chunk_factor * suffix_chunk`` tokens: the steady
    decode steps of one batch then cost a few numpy calls instead of a full build. After a full
    build, last chunks hold at most ``suffix_chunk`` tokens, so a batch rebuilds at most once per
    ``(reuse_chunk_factor - 1) * suffix_chunk`` steps. 0 disables reuse."""
    prefix_kernel: PrefixKernel = "pointer"
    """Prefix launch kernel: "pointer" (pointer loads, software-pipelined by ``prefix_stages``),
    "descriptor" (Hopper-class: the full K/V tiles come through host-side tensor descriptors,
    i.e. TMA loads on sm90+, in a ``tl.range`` loop pipelined by ``prefix_stages`` and, with
    ``prefix_warp_specialize``, warp-specialised; the masked tail stays a pointer load; a KV
    buffer it cannot describe is a ValueError), or "auto" (descriptor wherever the layer's
    buffers are contiguous fp16 / bf16 / fp32, pointer otherwise, e.g. an FP8 cache; and on sm90
    "wgmma" wherever that kernel can run the launch: ``prefix_attention.auto_prefix_kernel``).
    "wgmma": the Gluon kernel for sm90 (``prefix_wgmma``: TMA stages, asynchronous warp-group
    MMAs, scores of the next tile overlapped with P @ V of the last); fp16 / bf16 throughout,
    head_dim 64 / 128, block_m 64 / 128, contiguous buffers, else a ValueError naming what does
    not fit. ``tile_config`` picks "auto" on sm90+: on an H200 the descriptor kernel's cascade layer was
    never slower than the pointer kernel's beyond noise (+0.3 us) and up to 8.5% faster at 16K
    prefixes, its prefix launch 9-12% faster (docs/results/kernels.md, "TMA prefix loads"); on an
    H100 the wgmma kernel's prefix launch was 2-10% faster than the descriptor kernel's on every
    sweep case, its cascade layer 0-3% ("The wgmma prefix kernel in Gluon")."""
    prefix_mma_overlap: bool = True
    """With ``prefix_kernel="wgmma"``: each tile's scores are computed while the previous tile's
    P @ V is still on the tensor cores; False waits for every MMA at once (a ``tl.dot`` loop's
    schedule, for comparison)."""
    prefix_q_registers: bool = False
    """With ``prefix_kernel="wgmma"``: the query tile stays in registers as the A operand of
    S = Q K^T, so each tile's MMAs read only K and V from shared memory and the program holds no
    query tile there (16 KB less at block_m 64, head_dim 128; 183 registers per thread instead of
    153, still two programs per SM). ``tile_config`` turns it on with TMA: on an H100 the prefix
    launch was 4% faster at 16K x 128 and equal on the other sweep cases (sweep variant
    ``wgmma_qreg``; docs/results/kernels.md, "The query in registers")."""
    prefix_warp_specialize: bool = False
    """With ``prefix_kernel="descriptor"``: ``tl.range(..., warp_specialize=True)`` (producer
    warps issue the loads, consumer warps the MMAs). With "wgmma": the warp-specialized Gluon
    kernel, a producer warp (TMA loads, the gathered query rows, the masked last tile) and two
    consumer warpgroups of 64 rows sharing one K/V ring (``block_m`` must be 128; one program
    per SM, so ``prefix_waves`` 1.0 is one wave)."""
    forest_items_per_tile: float = 0.0
    """Many-group steps (forests): the prefix launch aims at no fewer than this many items per
    (group, row tile), so that long prefixes are cut to about the length of the short ones
    instead of one item each (64 groups of 0.5-4K tokens: one chunk bound of ~1.2K instead of
    6.4K; a list-scheduling model of the launch puts it 13-18% closer to the ideal). 0 keeps
    the plain ``prefix_waves`` target. Off until measured on the GPU (``--sweep``, "forest2")."""
    suffix_head_group: bool = True
    """A suffix program serves as many kv heads as fit the 16 rows of its tile (``suffix_heads``)
    instead of one kv head with padded rows: same MMA work, 1/heads the programs, contiguous reads."""
    suffix_max_keys: int = 256
    """Gathered keys per suffix tile at most (``suffix_block_n`` x kv heads per program): bounds
    the tile's shared memory. 256 keys x head_dim 128 in bf16 fit an H200 SM; 512 x 128 (MHA,
    16 heads per program) does not (282 KB asked, 227 KB available). ``tile_config`` scales it
    by 128 / head_dim."""

    merge_block_p: int = 1
    """Partial rows the merge loads per step: 1 walks a request's rows one by one, per (request,
    kv head) (two dependent loads each); a power of two > 1 loads that many rows of one q-head at
    once as one tile, per (request, q-head), and folds them in with a running max
    (merge_state.py). 32 on an H200 (max_bs 256): the cascade layer 9-13% faster where few
    requests carry many partial rows (8 requests on 4K, 24 on 10K), 1-9% slower at 64-128
    requests (the programs past the live batch are 4x as many); docs/results/kernels.md."""

    merge_in_kernels: bool = False
    """The cascade path's merge done inside its prefix and suffix launches instead of a third
    launch: each program, after writing its partial rows, counts one arrival per row (request,
    q-head) on the workspace's ``counters``, and the program whose arrival completes a row's
    partial rows merges it into the output (``merge_state.MergeTarget``; the fused kernel's
    scheme over two launches). Nobody waits on anyone, so the merge's work overlaps the
    launches' tails instead of following both. Every prefix kernel but the warp-specialized
    wgmma one. Off: on an H100 it was slower than the merge launch on 4 of 6 sweep cases (up
    to 12.4 µs per layer on a forest of 16) and equal on 2; the merges gather in the programs
    that finish last (docs/results/kernels.md, "The merge in the launches")."""

    merge_rows: Literal["workspace", "batch"] = "workspace"
    """Program rows of the merge launch: one per request slot of the workspace ("workspace", its
    ``max_bs``; a graph sized for 256 requests launches 256 rows whatever its batch), or one per
    row of the output ("batch": a captured graph's padded batch, which its live batch never
    exceeds), so that a small batch's merge launches no idle programs. Not measured on a GPU yet
    (sweep variants ``merge_rows_batch``, ``merge32_rows_batch``)."""

    fp8_math: Literal["fp16", "query"] = "fp16"
    """Over an FP8 cache with a bf16 query: "fp16" widens the FP8 K/V tiles to fp16 and runs the
    dots in fp16 with the query pre-scaled and rounded to fp16 (``prefix_attention._math_query``:
    exact widening in one ``cvt`` per two values on sm89+, 11 significant bits in the dots);
    "query" widens them to bf16, the query's dtype (three instructions per two values). Both
    accumulate in fp32 and read the same bytes; an fp16 / fp32 query is unaffected."""

    prefix_softmax: Literal["scaled", "fma", "lazy"] = "scaled"
    """The prefix kernels' online softmax (``prefix_attention._prefix_softmax_step``): "scaled"
    scales each score, then shifts it by the running max; "fma" takes the row max of the
    unscaled scores and scales and shifts each score in one fused multiply-add (one
    floating-point operation per score fewer); "lazy" is "fma" with the running max moved only
    when a tile's max exceeds it by more than 2**8, so the rescale of the [rows, head_dim]
    accumulator is skipped (a branch of the whole program) on the tiles where no row's max moved
    that far: most tiles of a long prefix. Measured on an H100 (sweep variants ``sm_fma``,
    ``sm_lazy``; docs/results/kernels.md, "The prefix kernels' online softmax"): "fma" equal to
    "scaled", "lazy" 3-24% slower in the prefix launch (its per-tile branch reduces across the
    program's warps). The launch waits on latency, not on instruction count, so "scaled" stays."""

    prefix_maxnreg: int = 0
    """Registers per thread the prefix launches may use at most (Triton's ``maxnreg``; 0: the
    compiler's choice, 222 at Llama-3.1-8B heads on sm90). The prefix launch runs two 4-warp
    programs per SM, bound by registers and shared memory, and its tensor pipe waits on latency
    (docs/results/kernels.md): a cap of 168 with a smaller shared-memory footprint (``block_n``
    32, or 2 stages) leaves room for a third program per SM, at the price of spills. Not
    measured on a GPU yet (sweep variants ``nreg*``)."""

    def __post_init__(self) -> None:
        if self.prefix_maxnreg and not 24 <= self.prefix_maxnreg <= 255:
            raise ValueError(f"prefix_maxnreg={self.prefix_maxnreg} must be 0 (the compiler's choice) or in [24, 255]")
        if self.prefix_softmax not in PREFIX_SOFTMAX_MODES:
            raise ValueError(f"prefix_softmax={self.prefix_softmax!r} must be one of {', '.join(PREFIX_SOFTMAX_MODES)}")
        if self.fp8_math not in ("fp16", "query"):
            raise ValueError(f"fp8_math={self.fp8_math!r} must be 'fp16' or 'query'")
        if self.merge_rows not in ("workspace", "batch"):
            raise ValueError(f"merge_rows={self.merge_rows!r} must be 'workspace' or 'batch'")
        if self.prefix_kernel not in PREFIX_KERNELS:
            raise ValueError(f"prefix_kernel={self.prefix_kernel!r} must be one of {', '.join(PREFIX_KERNELS)}")
        if self.merge_in_kernels and self.prefix_warp_specialize and self.prefix_kernel in ("wgmma", "auto"):
            raise ValueError("merge_in_kernels needs a prefix kernel with the arrival epilogue: not the "
                             "warp-specialized wgmma kernel (prefix_warp_specialize with prefix_kernel "
                             f"{self.prefix_kernel!r})")
        if self.merge_block_p < 1 or self.merge_block_p & (self.merge_block_p - 1):
            raise ValueError(f"merge_block_p={self.merge_block_p} must be a power of two >= 1")
        for name in ("block_m", "block_n", "suffix_block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16")


SHAPE_TILES: Dict[Union[str, Tuple[int, int]], Dict[str, Any]] = {
    # head_dim > 128: smaller tiles to fit the register file (untuned)
    "head_dim>128": dict(block_m=32, block_n=32, prefix_warps=4, suffix_block_n=16),
    # GQA 8 at head_dim 64 (gpt-oss): smaller tiles leave room for more programs per SM, so the
    # prefix launch aims at 2 waves; cascade layer 100.8 -> 68.9 us at 16K x 64, 55.6 -> 51.8 at
    # the 4-group mix, forests within 1.5% (H200, docs/results/kernels.md, "Per-shape tiles")
    (8, 64): dict(prefix_waves=2.0),
}
"""Overrides of the defaults per head shape. The defaults are the H200 tuning at Llama-3.1-8B
heads (GQA 4, head_dim 128; docs/results/kernels.md). With flat rows no GQA ratio pads a
prefix tile by more than its last rows, so ratios 1-8 at head_dim 64 / 128 keep the defaults
until ``bench_attention.py --shape NAME --sweep`` measures a better tile for one of them; a
measured winner goes here as ``(ratio, head_dim): overrides``."""


def device_has_tma(device: Any) -> bool:
    """A CUDA device of compute capability 9.0 or later (TMA: the descriptor prefix kernel)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def tile_config(ratio: int, head_dim: int, *, tma: bool = False) -> KernelConfig:
    """The kernel config for ``ratio`` q-heads per kv head at ``head_dim``; ``tma``: the device
    has TMA (``device_has_tma``), so the prefix kernel is "auto" (the wgmma kernel on sm90 or
    descriptor loads, wherever the buffers allow them) with the query in registers."""
    if ratio < 1 or head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head shape (GQA ratio {ratio}, head_dim {head_dim}) needs ratio >= 1 and a "
                         f"power-of-two head_dim >= 16")
    over = SHAPE_TILES.get((ratio, head_dim))
    if over is None and head_dim > 128:
        over = SHAPE_TILES["head_dim>128"]
    base = replace(KernelConfig(), suffix_max_keys=max(16, KernelConfig.suffix_max_keys * 128 // head_dim),
                   prefix_kernel="auto" if tma else "pointer", prefix_q_registers=tma)
    return replace(base, **(over or {}))


def device_config(ratio: int, head_dim: int, device: Any, prefix_kernel: PrefixKernel = "auto") -> KernelConfig:
    """``tile_config`` for ``device`` (TMA where it has it), with ``prefix_kernel`` where it names
    one ("auto": the config's own choice; ``--granikv-prefix-kernel``)."""
    cfg = tile_config(ratio, head_dim, tma=device_has_tma(device))
    return cfg if prefix_kernel == "auto" else replace(cfg, prefix_kernel=prefix_kernel)


def default_config(head_dim: int) -> KernelConfig:
    """``tile_config`` at GQA ratio 4 (the shape the defaults were tuned at)."""
    return tile_config(4, head_dim)
