"""GPU-host checks at real shapes in bf16 (skipped on CPU/CI): Llama-3.1-8B heads 32q/8kv/128 and
Qwen2.5 40q/8kv/128, a 16K shared prefix with 64 requests plus ungrouped requests; agreement with
SGLang's own paged Triton decode kernel on the same KV; CUDA-graph replay after a refill.

Tolerance: bf16 operands (8-bit mantissa) and bf16 softmax probabilities put the relative error
||out - ref|| / ||ref|| between 1e-3 and 1e-2; we require < 1e-2 and no NaN. The device-ends
replay test compares each request elementwise instead (one wrong end must fail it).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import fill, make_batch

from support.graph_replay import eager_equals_replay
from support.per_request import assert_per_request
from support.query_rows import query_rows_ref
from granikv.kernels.cascade import bgemm_cascade_attention, cascade_attention, fused_cascade_attention
from granikv.kernels.graph_capture import capture_graph
from granikv.kernels.kernel_config import tile_config
from granikv.kernels.reference import decode_attention_ref
from granikv.attention.decode.work_list import KernelConfig
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.plan import Grouping

pytestmark = pytest.mark.gpu
PATHS = {"cascade": cascade_attention, "fused": fused_cascade_attention, "bgemm": bgemm_cascade_attention}


def _rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in output (unwritten rows?)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def _batch(hq, groups=((16384, 64),), n_ungrouped=4, seed=0):
    b = make_batch(groups=groups, n_ungrouped=n_ungrouped, suffix=256, ungrouped_len=3000, num_q_heads=hq,
                   num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=seed)
    b.q *= 4  # peaky softmax, so that wrong keys would show
    return b


def _ref(b):
    return decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o


@pytest.mark.parametrize("hq", [32, 40])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("merge_block_p", [1, 8])
def test_real_shapes_bf16(hq, path, merge_block_p):
    if merge_block_p > 1 and path == "fused":
        pytest.skip("the fused kernel merges in its own last-arriving program")
    b = _batch(hq)
    cfg = replace(tile_config(hq // 8, 128, tma=True), merge_block_p=merge_block_p)
    ws = CascadeWorkspace(128, hq, 8, 128, "cuda", config=cfg)
    fill(ws, b, single_prefix_chunk=path == "bgemm")
    out = torch.full_like(b.q, float("nan"))
    PATHS[path](b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    assert _rel_err(out, _ref(b)) < 1e-2
    assert (ws.counters == 0).all()


def _sglang_decode(b):
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    bs, hq, d = b.q.shape
    rows = torch.as_tensor(b.req_pool_indices, device="cuda")
    lens = torch.as_tensor(b.seq_lens, device="cuda")
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = lens.cumsum(0)
    idx = torch.cat([b.req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist())]).long()
    splits = 16
    o = torch.empty_like(b.q)
    logits = torch.empty(bs, hq, splits, d, dtype=torch.float32, device="cuda")
    lse = torch.empty(bs, hq, splits, dtype=torch.float32, device="cuda")
    nsp = torch.full((bs,), splits, dtype=torch.int32, device="cuda")
    decode_attention_fwd(b.q, b.k, b.v, o, indptr, idx, logits, lse, nsp, splits, b.sm_scale, 1.0, 1.0)
    return o


@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_matches_sglang_triton_decode(path):
    b = _batch(32, groups=((16384, 48), (4096, 16)))
    ws = CascadeWorkspace(128, 32, 8, 128, "cuda")
    fill(ws, b)
    out = PATHS[path](b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    sgl = _sglang_decode(b)
    ref = _ref(b)
    assert _rel_err(sgl, ref) < 1e-2  # the baseline itself is within the same bound
    assert _rel_err(out, sgl.double()) < 1e-2


@pytest.mark.parametrize("order", [{}, dict(suffix_first=True), dict(suffix_priority=True),
                                   dict(suffix_priority=True, suffix_first=True, prefix_waves=2.0)])
def test_overlapped_suffix_eager_and_graph(order):
    """overlap_suffix (suffix launch on a side stream): bit-identical to the serial launches,
    eager and as a CUDA-graph replay (fork/join captured), and the side work is joined before
    cascade_attention returns; likewise with the suffix launch issued first and / or its stream
    at the highest priority (``order``). Knobs that change the split (``prefix_waves``) apply to
    the serial launches too: only the launch order may differ between the two."""
    b = _batch(32, groups=((16384, 48), (4096, 16)))
    split = {k: v for k, v in order.items() if k not in ("suffix_first", "suffix_priority")}
    outs = []
    for overlap in (False, True):
        cfg = KernelConfig(overlap_suffix=overlap, **(order if overlap else split))
        ws = CascadeWorkspace(128, 32, 8, 128, "cuda", config=cfg)
        assert (ws.side_stream is not None) == overlap
        if overlap:
            assert (ws.side_stream.priority < 0) == cfg.suffix_priority
        fill(ws, b)
        out = torch.full_like(b.q, float("nan"))
        fn = lambda: cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)  # noqa: E731
        outs.append(eager_equals_replay(fn, out))  # the eager copy unsynchronized: ordered after the side stream
    assert _rel_err(outs[1], _ref(b)) < 1e-2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("hq,hkv,head_dim,sinks", [(32, 8, 128, False), (28, 4, 128, False), (64, 8, 64, True)])
def test_merge_in_kernels_bf16_eager_and_graph(hq, hkv, head_dim, sinks):
    """KernelConfig.merge_in_kernels on the config tile_config picks (the wgmma prefix kernel on
    sm90, its suffix on the side stream): every request against the float64 reference, eager
    and as back-to-back CUDA-graph replays bit-identical, every arrival counter zero after each;
    and the same outputs as the merge launch within rounding (the same partial rows, merged in
    another order of programs)."""
    b = make_batch(groups=((16384, 48), (4096, 16), (1000, 3)), n_ungrouped=5, suffix=256, ungrouped_len=3000,
                   num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, dtype=torch.bfloat16, device="cuda", seed=3)
    b.q *= 4  # peaky softmax, so that wrong keys would show
    sink = (torch.randn(hq, device="cuda") + 3.0).float() if sinks else None
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale, sink).o
    outs = []
    for in_kernels in (False, True):
        cfg = replace(tile_config(hq // hkv, head_dim, tma=True), merge_in_kernels=in_kernels)
        ws = CascadeWorkspace(128, hq, hkv, head_dim, "cuda", config=cfg)
        fill(ws, b)
        out = torch.full_like(b.q, float("nan"))
        fn = lambda: cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale,  # noqa: E731
                                       out=out, sinks=sink)
        outs.append(eager_equals_replay(fn, out))
        torch.cuda.synchronize()
        assert (ws.counters == 0).all(), "arrival counters not reset"
        _assert_per_request(outs[-1], ref)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_cuda_graph_replay_after_refill(path):
    """Capture once with grouping A; refill with a DIFFERENT grouping B (same bs); replay."""
    a = _batch(32, groups=((4096, 24), (2048, 16)), n_ungrouped=8, seed=1)
    bb = _batch(32, groups=((8192, 8), (1000, 20), (3000, 10)), n_ungrouped=10, seed=2)
    assert a.bs == bb.bs
    slots = max(a.k.shape[0], bb.k.shape[0])
    ctx = max(a.req_to_token.shape[1], bb.req_to_token.shape[1])
    rows = max(a.req_to_token.shape[0], bb.req_to_token.shape[0])
    k_s = torch.zeros(slots, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_s, q_s, out_s = torch.zeros_like(k_s), torch.zeros_like(a.q), torch.zeros_like(a.q)
    r2t_s = torch.zeros(rows, ctx, dtype=torch.int32, device="cuda")

    def load(b):
        k_s[: b.k.shape[0]] = b.k
        v_s[: b.v.shape[0]] = b.v
        q_s.copy_(b.q)
        r2t_s.zero_()
        r2t_s[: b.req_to_token.shape[0], : b.req_to_token.shape[1]] = b.req_to_token

    ws = CascadeWorkspace(a.bs, 32, 8, 128, "cuda")
    load(a)
    fill(ws, a)
    fn = lambda: PATHS[path](q_s, k_s, v_s, r2t_s, ws.plan, sm_scale=a.sm_scale, out=out_s)  # noqa: E731
    g = capture_graph(fn)  # compiles and warms up outside the capture
    g.replay()
    assert _rel_err(out_s, _ref(a)) < 1e-2
    load(bb)
    fill(ws, bb)
    out_s.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert _rel_err(out_s, _ref(bb)) < 1e-2


GQA_SHAPES = {  # (q heads, kv heads) of the models the kernels are tuned for
    "llama-3.1-8b": (32, 8), "qwen2.5-7b": (28, 4), "qwen2.5-14b": (40, 8), "gqa3": (24, 8), "mha": (32, 32),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("model", list(GQA_SHAPES))
@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_every_gqa_shape_bf16(model, head_dim, path):
    """Each model's heads at head_dim 64 / 128 with the config ``tile_config`` picks for it
    (flat-row tiles straddle members at GQA 3 / 5 / 7): a forest of a long prefix with many
    sharers and short prefixes with few, plus ungrouped requests. Same tolerance as above."""
    hq, hkv = GQA_SHAPES[model]
    b = make_batch(groups=((8192, 37), (1500, 5), (3000, 2), (700, 9)), n_ungrouped=3, suffix=200,
                   ungrouped_len=1500, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                   dtype=torch.bfloat16, device="cuda", seed=hq + head_dim)
    b.q *= 4
    ws = CascadeWorkspace(64, hq, hkv, head_dim, "cuda")
    wl = fill(ws, b)
    ws.check_integrity()
    out = torch.full_like(b.q, float("nan"))
    PATHS[path](b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    torch.cuda.synchronize()
    assert _rel_err(out, _ref(b)) < 1e-2
    assert (ws.counters == 0).all() and wl.num_prefix_items > 0


@pytest.mark.parametrize("warp_specialize", [False, True])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (28, 4)])
def test_descriptor_prefix_kernel_bf16_eager_and_graph(hq, hkv, warp_specialize):
    """The tensor-descriptor (TMA) prefix kernel at a real shape (16K x 48 + 4K x 16): the
    cascade with it agrees with the reference and with the pointer kernel's cascade (both bf16
    flash attention over the same tiles: same tolerance), and replays as a CUDA graph."""
    import dataclasses

    from granikv.kernels.kernel_config import tile_config

    b = make_batch(groups=((16384, 48), (4096, 16)), n_ungrouped=4, suffix=256, ungrouped_len=3000,
                   num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=3)
    b.q *= 4
    outs = []
    for variant in ("pointer", "descriptor"):
        cfg = dataclasses.replace(tile_config(hq // hkv, 128), prefix_kernel=variant,
                                  prefix_warp_specialize=warp_specialize)
        ws = CascadeWorkspace(128, hq, hkv, 128, "cuda", config=cfg)
        fill(ws, b)
        out = torch.full_like(b.q, float("nan"))
        fn = lambda: cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)  # noqa: E731
        outs.append(eager_equals_replay(fn, out))
    ref = _ref(b)
    assert _rel_err(outs[1], ref) < 1e-2
    assert _rel_err(outs[1], outs[0].double()) < 1e-2


def test_steady_advances_on_the_device_match_a_host_fill():
    """Pinned double-buffered uploads on the GPU: 40 steady steps of a padded batch through
    ``advance`` (and the rebuilds it refuses into) leave, after each step's copy, the device
    metadata that a CPU workspace filling the padded arrays holds."""
    import numpy as np

    b = make_batch(suffix=40, ungrouped_len=70)
    extra = 3
    z = np.zeros(extra, np.int64)
    p_len, rpi = np.concatenate([b.prefix_len, z]), np.concatenate([b.req_pool_indices, z])
    kw = dict(sm_count=32, max_splits=4)
    ref = CascadeWorkspace(b.bs + extra, 8, 2, 64, "cpu", **kw)
    ws = CascadeWorkspace(b.bs + extra, 8, 2, 64, "cuda", **kw)
    for step in range(40):
        seq = b.seq_lens + step
        pad = np.concatenate([seq, np.ones(extra, np.int64)])
        ref.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, p_len), pad, rpi,
                 same_grouping=step > 0)
        if not ws.advance(seq, b.req_pool_indices, bs=b.bs + extra):
            ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, p_len), pad, rpi,
                    same_grouping=step > 0)
        torch.cuda.synchronize()
        assert torch.equal(ws.meta.cpu(), ref.meta), f"step {step}"
    assert ws.fills_reused == ref.fills_reused >= 20


def _new_tokens_matter(b, seq0, seq):
    """Each request's tokens ``[seq0, seq)`` get keys along its kv heads' mean query direction,
    scored about the log-sum-exp of its other tokens: each carries a large share of the softmax,
    so a replay that misses one fails the per-request check (one ordinary token among 16K would
    move the output less than bf16 rounds it)."""
    bs, hq, d = b.q.shape
    hkv = b.k.shape[1]
    lse = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, torch.as_tensor(seq0),
                               b.sm_scale).lse.view(bs, hkv, -1).mean(2)
    qg = b.q.double().view(bs, hkv, hq // hkv, d)
    u = qg.mean(2)
    u = u / u.norm(dim=-1, keepdim=True)
    alpha = lse / (b.sm_scale * (qg * u[:, :, None]).sum(-1).mean(2))  # [bs, hkv]: score ~ lse
    assert (alpha > 0).all()
    rows = torch.as_tensor(b.req_pool_indices, device=b.q.device)
    for i in range(bs):
        slots = b.req_to_token[rows[i], int(seq0[i]) : int(seq[i])].long()
        b.k[slots] = (alpha[i, :, None] * u[i]).to(b.k.dtype)


def _assert_per_request(out, ref):
    # bf16 P, V and output (8-bit mantissa): measured errors < 1e-2 x max |ref| / 4
    assert_per_request(out, ref, atol=1e-2, rtol=1e-2, atol_floor=0.0)


@pytest.mark.parametrize("wrong", [None, "first", "middle", "last"])
@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_device_ends_under_graph_replay_bf16(path, wrong):
    """Serving's steady steps (``SuffixEnds.bind``): the graph is captured over a padded batch
    (4 graph padding rows: prefix 0, row 0, device seq_len 0) whose suffix ends come from a
    device seq_lens buffer; each step refills that buffer, the workspace advances in place (no
    upload: ``meta`` unchanged) and copies the ends to ``CascadeWorkspace.ends``. Three replays
    run back to back (no synchronize until the comparison); every request of every step must
    match the float64 reference elementwise, padding rows their one token. ``wrong``: the
    planted fault, one request's end left at the previous step's length on the middle replay;
    the check must name that request (16K x 64 + ungrouped, bf16)."""
    b = _batch(32, seed=5)
    n, pad = b.bs, 4
    steps = [b.seq_lens - s for s in (2, 1, 0)]
    seq0 = b.seq_lens - 3
    _new_tokens_matter(b, seq0, b.seq_lens)
    zeros = np.zeros(pad, np.int64)
    sl = torch.as_tensor(np.concatenate([seq0, zeros]), device="cuda")  # SGLang's static seq_lens buffer
    step_lens = [torch.as_tensor(np.concatenate([s, zeros]), device="cuda") for s in steps]  # made before the loop
    rows = np.concatenate([b.req_pool_indices, zeros])
    ws = CascadeWorkspace(n + pad, 32, 8, 128, "cuda")
    ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, np.concatenate([b.prefix_len, zeros])),
            np.concatenate([seq0, np.ones(pad, np.int64)]), rows, seq_lens_dev=sl)  # fmt: skip
    q = torch.cat([b.q, b.q[:pad]])
    out = torch.empty_like(q)
    g = capture_graph(lambda: PATHS[path](q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out))
    torch.cuda.synchronize()
    meta = ws.meta.clone()
    outs = torch.empty(len(steps), *q.shape, dtype=q.dtype, device="cuda")
    p = None if wrong is None else {"first": 0, "middle": n // 2, "last": n - 1}[wrong]
    for s, seq in enumerate(steps):
        sl.copy_(step_lens[s])
        assert ws.advance(seq, b.req_pool_indices, bs=n + pad, seq_lens_dev=sl)
        if p is not None and s == 1:
            ws.ends.buffer[p : p + 1].sub_(1)  # the fault: request p ends where the previous step did
        out.fill_(float("nan"))
        g.replay()
        outs[s].copy_(out)
    torch.cuda.synchronize()
    assert torch.equal(ws.meta, meta) and ws.advances_in_place == len(steps)  # nothing uploaded
    pad_ref = decode_attention_ref(q[n:], b.k, b.v, b.req_to_token, zeros, np.ones(pad, np.int64), b.sm_scale).o
    for s, seq in enumerate(steps):
        ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, torch.as_tensor(seq),
                                   b.sm_scale).o
        _assert_per_request(outs[s, n:], pad_ref)  # padding rows: their one token (row 0, slot 0)
        if p is not None and s == 1:
            with pytest.raises(AssertionError, match=f"^request {p}: "):
                _assert_per_request(outs[s, :n], ref)
            others = [i for i in range(n) if i != p]
            _assert_per_request(outs[s, others], ref[others])
        else:
            _assert_per_request(outs[s, :n], ref)


@pytest.mark.parametrize("tokens", [2, 4, 8])
@pytest.mark.parametrize("hq,hkv,head_dim", [(32, 8, 128), (28, 4, 128), (64, 8, 64)])
def test_query_tokens_bf16_eager_and_graph(tokens, hq, hkv, head_dim):
    """A verify step's shape (``query_tokens.expand_query_tokens``: T query tokens per request
    as T decode rows each) through the cascade on the config tile_config picks: every query row
    against float64 attention over its request's keys up to its own position, and back-to-back
    CUDA-graph replays bit-identical to the eager launch."""
    from granikv.attention.decode.query_tokens import expand_query_tokens

    b = make_batch(groups=((16384, 24), (4096, 8)), n_ungrouped=3, suffix=256, ungrouped_len=3000,
                   num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, dtype=torch.bfloat16, device="cuda", seed=5)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = 4 * torch.randn(b.bs * tokens, hq, head_dim, generator=g, device="cuda").to(torch.bfloat16)
    rows = expand_query_tokens(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx,
                                           b.prefix_len), b.seq_lens, b.req_pool_indices, tokens)
    ws = CascadeWorkspace(b.bs * tokens, hq, hkv, head_dim, "cuda", config=tile_config(hq // hkv, head_dim, tma=True))
    ws.fill(rows.grouping, rows.seq_lens, rows.req_pool_indices)
    out = torch.full_like(q, float("nan"))
    out = eager_equals_replay(lambda: cascade_attention(q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale,
                                                        out=out), out)
    _assert_per_request(out, query_rows_ref(b, q, tokens))
