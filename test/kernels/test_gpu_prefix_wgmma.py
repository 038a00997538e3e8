"""GPU-host checks of the Gluon sm90 prefix kernel (``prefix_kernel="wgmma"``) at real shapes
in bf16 (skipped on CPU/CI and on GPUs other than sm90).

Each check runs the cascade with the wgmma prefix kernel and compares, per request, with the
float64 reference (bf16 operands and probabilities: the tolerance of the other GPU kernel
tests, 1e-2 of each request's largest output), and the prefix partial rows with the
descriptor kernel's on the same work list (both bf16 flash attention over the same tiles). The
planted fault (every prefix item's extent moved by one slot) must fail the same comparison.
"""

from dataclasses import replace

import pytest
import torch
from conftest import fill, make_batch

from support.graph_replay import eager_equals_replay
from support.per_request import assert_per_request
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.cascade import cascade_attention
from granikv.kernels.kernel_config import tile_config
from granikv.kernels.prefix_attention import prefix_attention
from granikv.kernels.reference import decode_attention_ref

pytestmark = pytest.mark.gpu


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the wgmma prefix kernel runs on sm90 only")

GQA_SHAPES = {"llama-3.1-8b": (32, 8), "qwen2.5-7b": (28, 4), "gqa3": (24, 8), "gqa5": (40, 8), "gqa7": (28, 4 * 1),
              "mha": (16, 16)}
FOREST = ((8191, 37), (1501, 5), (3000, 2), (701, 9), (63, 3))  # lengths off every tile; a prefix under one tile


def _batch(hq, hkv, head_dim, groups=FOREST, seed=0):
    b = make_batch(groups=groups, n_ungrouped=3, suffix=201, ungrouped_len=1500, num_q_heads=hq, num_kv_heads=hkv,
                   head_dim=head_dim, dtype=torch.bfloat16, device="cuda", seed=seed)
    b.q *= 4  # peaky softmax, so that wrong keys would show
    return b


def _ref(b):
    return decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o


def _cascade(b, cfg, hq, hkv, head_dim, plant=False):
    ws = CascadeWorkspace(64, hq, hkv, head_dim, "cuda", config=cfg)
    wl = fill(ws, b)
    if plant:  # every prefix item reads its extent one slot later
        ws.pfx_items[2 * ws.prefix_cap : 2 * ws.prefix_cap + wl.num_prefix_items] += 1
    out = torch.full_like(b.q, float("nan"))
    cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "NaN in output (unwritten rows?)"
    return out, ws, wl


def _check(out, ref):
    assert_per_request(out, ref, atol=1e-2, rtol=1e-2, atol_floor=0.0)


SCHEDULES = {  # the wgmma kernels' schedules: overlapped MMAs, the query in registers, every MMA waited,
    # warp-specialized
    "overlap": dict(prefix_q_registers=False), "qreg": dict(prefix_q_registers=True), "waited": dict(prefix_mma_overlap=False),
    "ws": dict(block_m=128, prefix_warp_specialize=True, prefix_waves=1.0),
}


@needs_sm90
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("model", list(GQA_SHAPES))
def test_wgmma_prefix_every_gqa_shape(model, head_dim, schedule):
    hq, hkv = GQA_SHAPES[model]
    b = _batch(hq, hkv, head_dim, seed=hq + head_dim)
    base = tile_config(hq // hkv, head_dim, tma=True)
    cfg = replace(base, prefix_kernel="wgmma", **SCHEDULES[schedule])
    out, ws, wl = _cascade(b, cfg, hq, hkv, head_dim)
    assert wl.num_prefix_items > 0
    _check(out, _ref(b))
    # the prefix partial rows against the descriptor kernel's, on the same work list
    mine_o, mine_lse = _prefix_partials(b, cfg, hq, hkv, head_dim)
    desc_o, desc_lse = _prefix_partials(b, replace(cfg, prefix_kernel="descriptor", prefix_warp_specialize=False),
                                        hq, hkv, head_dim)
    written = ~torch.isnan(desc_lse)
    assert torch.equal(~torch.isnan(mine_lse), written), "the two kernels wrote different partial rows"
    torch.testing.assert_close(mine_lse[written], desc_lse[written], atol=2e-2, rtol=0)
    torch.testing.assert_close(mine_o[written], desc_o[written], atol=2e-2, rtol=2e-2)


def _prefix_partials(b, cfg, hq, hkv, head_dim):
    """The prefix launch alone over a NaN-filled partial table: (part_o, part_lse)."""
    ws = CascadeWorkspace(64, hq, hkv, head_dim, "cuda", config=cfg)
    fill(ws, b)
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    prefix_attention(b.q, b.k, b.v, ws.plan, sm_scale=b.sm_scale)
    torch.cuda.synchronize()
    return ws.part_o, ws.part_lse


@needs_sm90
@pytest.mark.parametrize("kw", [dict(), dict(prefix_stages=2), dict(prefix_stages=4), dict(block_n=128, prefix_stages=2),
                                dict(block_m=128, prefix_stages=2), dict(block_n=32), dict(block_n=32, prefix_maxnreg=168),
                                SCHEDULES["ws"], dict(SCHEDULES["ws"], prefix_stages=4), dict(SCHEDULES["ws"], prefix_stages=2),
                                SCHEDULES["qreg"], dict(SCHEDULES["qreg"], prefix_stages=2),
                                dict(SCHEDULES["qreg"], block_n=32, prefix_stages=4)],
                         ids=["default", "s2", "s4", "bn128", "bm128", "bn32", "bn32_nreg168", "ws", "ws_s4", "ws_s2",
                              "qreg", "qreg_s2", "qreg_bn32_s4"])
def test_wgmma_prefix_16k_eager_and_graph(kw):
    """Llama-3.1-8B heads, 16K x 64 + 4K x 16 (the grid's headline shape): per-request agreement
    with the reference; a CUDA-graph replay gives the eager output bit for bit."""
    b = _batch(32, 8, 128, groups=((16384, 64), (4096, 16)), seed=7)
    cfg = replace(tile_config(4, 128, tma=True), prefix_kernel="wgmma", **kw)
    ws = CascadeWorkspace(128, 32, 8, 128, "cuda", config=cfg)
    fill(ws, b)
    out = torch.full_like(b.q, float("nan"))
    fn = lambda: cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)  # noqa: E731
    _check(eager_equals_replay(fn, out), _ref(b))


@needs_sm90
def test_auto_launches_the_wgmma_kernel_on_sm90():
    """``tile_config(tma=True)``'s "auto" on this sm90 GPU: the wgmma kernel with the query in
    registers (bf16, head_dim 128), the descriptor kernel over fp32."""
    from granikv.kernels.prefix_attention import auto_prefix_kernel

    cfg = tile_config(4, 128, tma=True)
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(256, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert cfg.prefix_q_registers and auto_prefix_kernel(q, kv, kv, cfg) == "wgmma"
    assert auto_prefix_kernel(q.float(), kv.float(), kv.float(), cfg) == "descriptor"


@needs_sm90
@pytest.mark.parametrize("schedule", ["overlap", "qreg", "ws"])
def test_wgmma_prefix_planted_fault_fails_the_check(schedule):
    """Every prefix item's extent moved by one slot: the per-request check must fail."""
    hq, hkv = GQA_SHAPES["llama-3.1-8b"]
    b = _batch(hq, hkv, 128, seed=11)
    cfg = replace(tile_config(4, 128, tma=True), prefix_kernel="wgmma", **SCHEDULES[schedule])
    out, _, _ = _cascade(b, cfg, hq, hkv, 128, plant=True)
    with pytest.raises(AssertionError):
        _check(out, _ref(b))
