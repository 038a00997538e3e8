"""Every GQA shape: flat-row prefix tiles (work_list.py) and the per-shape tile choice
(kernel_config.py), and the cascade paths at GQA 1 / 3 / 5 / 7 and head_dim 64 / 128 against the
float64 reference (Triton interpreter on CPU).

Tolerances as test_cascade.py: fp32 inputs, full fp32 math, 2e-5; fp16 inputs, softmax
probabilities rounded to fp16 before the P.V dot plus one fp16 rounding of the output, 4e-3.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from granikv.kernels.cascade import cascade_attention, fused_cascade_attention
from granikv.kernels.kernel_config import KernelConfig, tile_config
from granikv.kernels.prefix_attention import prefix_attention
from granikv.kernels.reference import decode_attention_ref, partials_ref
from granikv.attention.decode.work_list import build_prefix_items
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.plan import Grouping

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
MODELS = {  # (q heads, kv heads): the model shapes the kernels are tuned for
    "llama-3.1-8b": (32, 8), "qwen2.5-7b": (28, 4), "qwen2.5-14b": (40, 8), "gqa3": (24, 8), "mha": (32, 32),
}


@pytest.mark.parametrize("ratio", [1, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("members", [2, 9, 64, 256])
def test_prefix_tiles_are_full_whatever_the_ratio(ratio, members):
    """A group of n members takes ceil(n * ratio / block_m) tiles: every tile but the last holds
    block_m rows, each (member, q-head) row exactly once."""
    cfg = KernelConfig()
    items = build_prefix_items(Grouping.of([100], [4096], [0, members], np.arange(members), np.full(members, 4096)),
                               members, ratio=ratio,
                               num_kv_heads=8, config=cfg, sm_count=132, max_splits=32)
    chunks = int(items.split.max()) + 1
    tiles = -(-members * ratio // cfg.block_m)
    assert items.row_lo.shape[0] == chunks * tiles
    for c in range(chunks):
        lo, hi = items.row_lo[items.split == c], items.row_hi[items.split == c]
        assert lo.tolist() == list(range(0, members * ratio, cfg.block_m)) and hi[-1] == members * ratio
        assert ((hi - lo)[:-1] == cfg.block_m).all()
    if ratio in (3, 5, 7) and tiles > 1:
        assert (items.row_lo % ratio != 0).any()  # a member's q-heads straddle two tiles


def test_forest_chunks_are_equal_within_each_group():
    """Few long and many short prefixes: one chunk bound, each group cut into equal chunks."""
    g_len = np.array([6000, 1500, 1537, 300, 4100] + [2000] * 11)
    n = np.array([4, 12, 7, 9, 5] + [6] * 11)
    ptr = np.concatenate([[0], np.cumsum(n)])
    start = np.concatenate([[1], 1 + np.cumsum(g_len)[:-1]])
    items = build_prefix_items(Grouping.of(start, g_len, ptr, np.arange(ptr[-1]), np.repeat(g_len, n)), int(ptr[-1]),
                               ratio=4, num_kv_heads=8,
                               config=KernelConfig(), sm_count=132, max_splits=32)
    assert (items.n_kv <= items.chunk).all()
    g_of = np.searchsorted(start, items.slot_lo, side="right") - 1
    for g in range(len(g_len)):
        mine = g_of == g
        k = int(items.split[mine].max()) + 1
        assert k == -(-int(g_len[g]) // items.chunk)  # long prefixes get more chunks
        gc = -(-(-(-int(g_len[g]) // k)) // 64) * 64  # ceil(len / k) up to a multiple of block_n
        kv = np.array([items.n_kv[mine & (items.split == c)][0] for c in range(k)])
        assert (kv[:-1] == gc).all() and 0 < kv[-1] == g_len[g] - (k - 1) * gc <= gc, (g, kv)
        assert (items.slot_lo[mine] == start[g] + items.split[mine] * gc).all()


@pytest.mark.parametrize("path", ["cascade", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio,hkv,head_dim", [(1, 2, 64), (3, 2, 64), (5, 1, 128), (7, 1, 64), (3, 1, 128),
                                                (7, 2, 128)])
def test_cascade_at_every_gqa_shape(path, dtype, ratio, hkv, head_dim):
    """Odd group sizes and prefix lengths so that tiles straddle members and chunks have tails."""
    b = make_batch(groups=((37, 7), (53, 3), (19, 2)), n_ungrouped=2, suffix=13, ungrouped_len=29,
                   num_q_heads=ratio * hkv, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, seed=ratio + head_dim)
    cfg = dataclasses.replace(SMALL_CONFIG, even_split=True)
    ws = CascadeWorkspace(b.bs + 1, ratio * hkv, hkv, head_dim, "cpu", config=cfg, sm_count=32, max_splits=4)
    wl = fill(ws, b)
    ws.check_integrity()
    if ratio > 1:
        assert (wl.pfx_row_lo % ratio != 0).any()  # a tile starting mid-member is exercised
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    out = torch.full_like(b.q, float("nan"))
    fn = cascade_attention if path == "cascade" else fused_cascade_attention
    fn(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert (ws.counters == 0).all()


def test_check_integrity_sees_a_q_head_written_twice_or_never():
    b = make_batch(groups=((37, 5),), n_ungrouped=1, num_q_heads=6, num_kv_heads=2)
    ws = CascadeWorkspace(b.bs, 6, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    wl = fill(ws, b)
    ws.check_integrity()
    hi = wl.pfx_row_hi.copy()
    hi[0] -= 1  # one q-head of one member never written
    ws.work_list = wl._replace(pfx_row_hi=hi)
    with pytest.raises(AssertionError, match="exactly once"):
        ws.check_integrity()
    lo = wl.pfx_row_lo.copy()
    lo[1] -= 1  # ... and one written by two tiles
    ws.work_list = wl._replace(pfx_row_lo=lo)
    with pytest.raises(AssertionError, match="exactly once"):
        ws.check_integrity()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_model_shape_gets_a_valid_config_and_workspace(model, head_dim):
    hq, hkv = MODELS[model]
    cfg = tile_config(hq // hkv, head_dim)
    ws = CascadeWorkspace(256, hq, hkv, head_dim, "cpu", sm_count=132)
    assert ws.config == cfg and ws.suffix_heads * (hq // hkv) <= ws.suffix_block_h


def test_tile_config_rejects_a_shape_the_kernels_cannot_serve():
    with pytest.raises(ValueError, match="head_dim 96"):
        tile_config(4, 96)
    assert tile_config(4, 256).block_m == 32


def test_forest_target_cuts_long_prefixes_to_the_short_ones_within_capacity():
    """64 groups of 0.5-4K tokens, 2-4 sharers: with forest_items_per_tile the chunk bound drops
    below the long prefixes (they get several items, short ones one) and the workspace sized
    from the same config still holds the step at its worst (every request its own group)."""
    rng = np.random.default_rng(3)
    g_len = rng.integers(512, 4097, 64)
    n = rng.integers(2, 5, 64)
    ptr = np.concatenate([[0], np.cumsum(n)])
    start = np.concatenate([[1], 1 + np.cumsum(g_len)[:-1]])
    args = (Grouping.of(start, g_len, ptr, np.arange(ptr[-1]), np.repeat(g_len, n)), int(ptr[-1]))
    kw = dict(ratio=4, num_kv_heads=8, sm_count=132, max_splits=32)
    plain = build_prefix_items(*args, config=KernelConfig(), **kw)
    cfg = KernelConfig(forest_items_per_tile=2.0)
    forest = build_prefix_items(*args, config=cfg, **kw)
    assert plain.n_kv.max() == g_len.max() and len(plain.n_kv) == 64  # one item per group
    assert forest.chunk < g_len.max() // 2 and len(forest.n_kv) >= 2 * 64 and forest.n_kv.max() <= forest.chunk
    bs = 256
    ws = CascadeWorkspace(bs, 32, 8, 16, "cpu", sm_count=132, config=cfg)
    b = make_batch(groups=[(700 + 13 * i, 1) for i in range(bs)], n_ungrouped=0, suffix=40, num_q_heads=32,
                   num_kv_heads=8, head_dim=16)
    fill(ws, b)
    ws.check_integrity()


def test_forest_target_cascade_matches_reference():
    b = make_batch(groups=((97, 2), (23, 3), (41, 2), (200, 4)), n_ungrouped=1, num_q_heads=6, num_kv_heads=2,
                   dtype=torch.float32, seed=5)
    cfg = dataclasses.replace(SMALL_CONFIG, forest_items_per_tile=3.0)
    ws = CascadeWorkspace(b.bs, 6, 2, 64, "cpu", config=cfg, sm_count=4, max_splits=16)
    wl = fill(ws, b)
    ws.check_integrity()
    assert wl.num_prefix_items > 4 * 2
    out = cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def _assert_prefix_partials_and_output(b, ws, wl, out, dtype):
    """The prefix partial states in ``ws`` against the float64 reference (o within ``TOL``, lse
    within 1e-4), and the cascade's ``out`` against the reference decode."""
    exp = partials_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, wl, b.sm_scale)
    for r in sorted(set(exp) - set(wl.sfx_row.tolist())):
        torch.testing.assert_close(ws.part_o[r].double(), exp[r].o, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(ws.part_lse[r].double(), exp[r].lse, atol=1e-4, rtol=1e-4)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("warp_specialize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio,hkv,head_dim", [(4, 2, 64), (3, 2, 128), (7, 1, 64), (1, 2, 64)])
def test_descriptor_prefix_kernel_matches_reference(warp_specialize, dtype, ratio, hkv, head_dim):
    """The tensor-descriptor (TMA) prefix kernel variant: same partial states as the reference
    (the interpreter runs descriptor loads; warp specialisation only changes code generation on
    the GPU), then the whole cascade with it."""
    b = make_batch(groups=((37, 7), (53, 3), (19, 2)), n_ungrouped=1, num_q_heads=ratio * hkv, num_kv_heads=hkv,
                   head_dim=head_dim, dtype=dtype, seed=ratio)
    cfg = dataclasses.replace(SMALL_CONFIG, prefix_kernel="descriptor", prefix_warp_specialize=warp_specialize)
    ws = CascadeWorkspace(b.bs, ratio * hkv, hkv, head_dim, "cpu", config=cfg, sm_count=32, max_splits=4)
    wl = fill(ws, b)
    assert (wl.pfx_n_kv % cfg.block_n != 0).any() and (wl.pfx_n_kv >= cfg.block_n).any()  # full tiles and tails
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    out = cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    _assert_prefix_partials_and_output(b, ws, wl, out, dtype)


def test_descriptor_kernel_rejects_a_strided_kv_buffer_and_a_bad_variant():
    b = make_batch(num_q_heads=4, num_kv_heads=2)
    cfg = dataclasses.replace(SMALL_CONFIG, prefix_kernel="descriptor")
    ws = CascadeWorkspace(b.bs, 4, 2, 64, "cpu", config=cfg, sm_count=32, max_splits=4)
    fill(ws, b)
    wide = torch.zeros(b.k.shape[0], 3, 64, dtype=b.k.dtype)[:, :2]  # [slots, 2, 64] with a row stride of 3 heads
    with pytest.raises(ValueError, match="contiguous"):
        prefix_attention(b.q, wide, wide, ws.plan, sm_scale=b.sm_scale)
    with pytest.raises(ValueError, match="prefix_kernel"):
        KernelConfig(prefix_kernel="tma")


@pytest.mark.parametrize("layout", ["contiguous", "strided", "fp8"])
def test_auto_prefix_kernel_uses_descriptors_where_the_buffers_allow(layout):
    """``prefix_kernel="auto"`` (sm90+, ``tile_config(tma=True)``): descriptor loads over
    contiguous fp16 buffers (a descriptor made once per buffer and tile, reused by the next
    call), pointer loads over a strided buffer and an FP8 cache; the same states either way."""
    from granikv.kernels import prefix_attention as pa

    b = make_batch(groups=((37, 7), (53, 3)), n_ungrouped=1, num_q_heads=8, num_kv_heads=2, head_dim=64,
                   dtype=torch.float16, seed=3)
    k, v = b.k, b.v
    if layout == "strided":
        k = torch.zeros(b.k.shape[0], 3, 64, dtype=b.k.dtype)[:, :2]
        k.copy_(b.k)
    elif layout == "fp8":
        k, v = b.k.to(torch.float8_e4m3fn), b.v.to(torch.float8_e4m3fn)
    cfg = dataclasses.replace(SMALL_CONFIG, prefix_kernel="auto")
    ws = CascadeWorkspace(b.bs, 8, 2, 64, "cpu", config=cfg, sm_count=32, max_splits=4)
    wl = fill(ws, b)
    pa._DESCRIPTORS.clear()
    ws.part_o.fill_(float("nan"))
    prefix_attention(b.q, k, v, ws.plan, sm_scale=b.sm_scale)
    assert len(pa._DESCRIPTORS) == (2 if layout == "contiguous" else 0)
    if layout == "contiguous":
        cached = dict(pa._DESCRIPTORS)
        prefix_attention(b.q, k, v, ws.plan, sm_scale=b.sm_scale)
        assert all(pa._DESCRIPTORS[key] is d for key, d in cached.items())
    exp = partials_ref(b.q, k.to(b.q.dtype), v.to(b.q.dtype), b.req_to_token, b.req_pool_indices, wl, b.sm_scale)
    for r in sorted(set(exp) - set(wl.sfx_row.tolist())):
        torch.testing.assert_close(ws.part_o[r].double(), exp[r].o, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_tile_config_picks_auto_with_tma_and_two_waves_for_gqa8_head_dim_64():
    from granikv.kernels.kernel_config import device_has_tma, tile_config

    assert tile_config(4, 128).prefix_kernel == "pointer"
    assert tile_config(4, 128, tma=True).prefix_kernel == "auto"
    assert tile_config(8, 64).prefix_waves == 2.0 and tile_config(4, 128).prefix_waves == 1.5
    assert not device_has_tma("cpu")
    if not torch.cuda.is_available():  # a CPU machine asked about "cuda" answers, never raises
        assert not device_has_tma("cuda")


def _tile_max_jumps(b, wl, block_n, qk_scale_log2):
    """Largest rise (base 2) of a row's running max at a later kv tile of any prefix item: the
    lazy softmax rescales only past ``LAZY_RESCALE_LOG2``, so a test that must exercise the
    rescale needs a rise above it (and one that must exercise the skip, rises below it)."""
    ratio = b.q.shape[1] // b.k.shape[1]
    worst = 0.0
    for w in range(wl.num_prefix_items):
        lo, n = int(wl.pfx_slot_lo[w]), int(wl.pfx_n_kv[w])
        k = b.k[lo:lo + n].double()  # [n, Hkv, D]
        q = b.q.double().view(b.q.shape[0], -1, ratio, b.q.shape[2])  # [bs, Hkv, ratio, D]
        s = torch.einsum("bhrd,nhd->bhrn", q, k) * qk_scale_log2  # every request: an upper bound is enough
        run = s[..., :block_n].amax(-1)
        for t in range(block_n, n, block_n):
            tile = s[..., t:t + block_n].amax(-1)
            worst = max(worst, float((tile - run).max()))
            run = torch.maximum(run, tile)
    return worst


@pytest.mark.parametrize("softmax", ["fma", "lazy"])
@pytest.mark.parametrize("kernel", ["pointer", "descriptor", "fused"])
@pytest.mark.parametrize("spikes", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_softmax_variants_match_reference(softmax, kernel, spikes, dtype):
    """``KernelConfig.prefix_softmax`` "fma" / "lazy" give the reference's partial states (the
    pointer, descriptor and fused prefix kernels). With ``spikes`` a few late keys of every
    extent are scaled up so that a row's max rises past ``LAZY_RESCALE_LOG2`` after the first
    tile (the lazy rescale taken; asserted on the data); without, every rise stays below it (the
    rescale skipped, the stale max kept)."""
    from granikv.kernels.prefix_attention import LAZY_RESCALE_LOG2, LOG2E

    ratio, hkv, head_dim = 3, 2, 64
    b = make_batch(groups=((150, 5), (97, 3), (41, 2)), n_ungrouped=1, num_q_heads=ratio * hkv, num_kv_heads=hkv,
                   head_dim=head_dim, dtype=dtype, seed=7)
    cfg = dataclasses.replace(SMALL_CONFIG, prefix_softmax=softmax, even_split=True,
                              prefix_kernel="descriptor" if kernel == "descriptor" else "pointer")
    ws = CascadeWorkspace(b.bs, ratio * hkv, hkv, head_dim, "cpu", config=cfg, sm_count=32, max_splits=2)
    wl = fill(ws, b)
    if spikes:
        for w in range(wl.num_prefix_items):
            lo, n = int(wl.pfx_slot_lo[w]), int(wl.pfx_n_kv[w])
            if n > cfg.block_n:
                late = lo + cfg.block_n + (n - cfg.block_n) // 2
                b.k[late] = b.k[late] * 12
    jump = _tile_max_jumps(b, wl, cfg.block_n, b.sm_scale * LOG2E)
    if spikes:
        assert jump > LAZY_RESCALE_LOG2.value, jump  # the data takes the rescale branch
    else:
        assert 0 < jump < LAZY_RESCALE_LOG2.value, jump  # rises, all skipped by the lazy max
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    if kernel == "fused":
        out = fused_cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    else:
        out = cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    _assert_prefix_partials_and_output(b, ws, wl, out, dtype)


def test_prefix_softmax_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="prefix_softmax"):
        dataclasses.replace(SMALL_CONFIG, prefix_softmax="exact")


def test_prefix_register_cap_is_passed_and_changes_no_result():
    """``KernelConfig.prefix_maxnreg`` reaches the prefix launches as Triton's ``maxnreg`` (the
    interpreter takes it; on a GPU it only changes register allocation) with the same partial
    states; out of range it is refused."""
    from granikv.kernels.prefix_attention import launch_limits

    assert launch_limits(SMALL_CONFIG) == {}
    cfg = dataclasses.replace(SMALL_CONFIG, prefix_maxnreg=168, even_split=True)
    assert launch_limits(cfg) == {"maxnreg": 168}
    b = make_batch(groups=((70, 4), (33, 2)), n_ungrouped=1, num_q_heads=8, num_kv_heads=2, dtype=torch.float32,
                   seed=5)
    for kind in ("pointer", "descriptor"):
        ws = CascadeWorkspace(b.bs, 8, 2, 64, "cpu", config=dataclasses.replace(cfg, prefix_kernel=kind),
                              sm_count=32, max_splits=2)
        wl = fill(ws, b)
        out = cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
        ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
        torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
        assert wl.num_prefix_items > 0
    out = fused_cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    for bad in (8, 256):
        with pytest.raises(ValueError, match="prefix_maxnreg"):
            dataclasses.replace(SMALL_CONFIG, prefix_maxnreg=bad)
