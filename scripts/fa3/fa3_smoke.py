"""FA3 smoke test of the minimal build: paged decode, paged extend and varlen prefill vs fp32 torch."""
import sys, time
import torch
from sgl_kernel.flash_attn import flash_attn_with_kvcache, flash_attn_varlen_func

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
ok = True


def ref(q, k, v, scale, causal_offset=None):
    # q [n,Hq,D], k/v [L,Hkv,D]; causal: query j sees keys [0, causal_offset + j]
    r = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(r, 1), v.float().repeat_interleave(r, 1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), kk) * scale
    if causal_offset is not None:
        m = torch.arange(k.shape[0], device=q.device)[None, :] > (causal_offset + torch.arange(q.shape[0], device=q.device))[:, None]
        s = s.masked_fill(m[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv)


def check(name, out, exp):
    global ok
    err = (out.float() - exp).abs().max().item() / max(exp.abs().max().item(), 1e-6)
    good = err < 2e-2
    ok &= good
    print(f"{'PASS' if good else 'FAIL'} {name}: rel max err {err:.2e}", flush=True)


for D in (128, 64):
    Hq, Hkv, N = 32, 8, 40000
    scale = D ** -0.5
    kc = torch.randn(N, 1, Hkv, D, device=dev, dtype=dt)
    vc = torch.randn(N, 1, Hkv, D, device=dev, dtype=dt)
    B = 8
    lens = torch.randint(100, 3000, (B,), device=dev, dtype=torch.int32)
    pt = torch.zeros(B, 4096, device=dev, dtype=torch.int32)
    for b in range(B):
        pt[b, : lens[b]] = torch.randperm(N, device=dev)[: lens[b]].int()
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=dt)
    for splits in (0, 1):
        t = time.time()
        o = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, softmax_scale=scale, causal=True,
                                   num_splits=splits)
        torch.cuda.synchronize()
        exp = torch.stack([ref(q[b], kc[pt[b, : lens[b]].long(), 0], vc[pt[b, : lens[b]].long(), 0], scale)[0]
                           for b in range(B)])
        check(f"decode D={D} splits={splits} ({time.time() - t:.2f}s)", o[:, 0], exp)
    # extend: new tokens with a cached prefix, through the page table (as SGLang's fa3 extend)
    new = torch.randint(1, 40, (B,), device=dev, dtype=torch.int32)
    cu = torch.zeros(B + 1, device=dev, dtype=torch.int32)
    cu[1:] = torch.cumsum(new, 0)
    tot = lens + new
    pt2 = torch.zeros(B, 4096, device=dev, dtype=torch.int32)
    for b in range(B):
        pt2[b, : tot[b]] = torch.randperm(N, device=dev)[: tot[b]].int()
    qe = torch.randn(int(cu[-1]), Hq, D, device=dev, dtype=dt)
    o = flash_attn_with_kvcache(qe, kc, vc, cache_seqlens=tot, page_table=pt2, cu_seqlens_q=cu,
                               max_seqlen_q=int(new.max()), softmax_scale=scale, causal=True)
    exp = torch.cat([ref(qe[cu[b]:cu[b + 1]], kc[pt2[b, : tot[b]].long(), 0], vc[pt2[b, : tot[b]].long(), 0], scale,
                         causal_offset=int(lens[b])) for b in range(B)])
    check(f"extend D={D}", o, exp)
    # ragged prefill
    k = torch.randn(int(cu[-1]), Hkv, D, device=dev, dtype=dt)
    v = torch.randn(int(cu[-1]), Hkv, D, device=dev, dtype=dt)
    o = flash_attn_varlen_func(qe, k, v, cu, cu, int(new.max()), int(new.max()), softmax_scale=scale, causal=True)
    o = o[0] if isinstance(o, tuple) else o
    exp = torch.cat([ref(qe[cu[b]:cu[b + 1]], k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]], scale, causal_offset=0)
                     for b in range(B)])
    check(f"varlen prefill D={D}", o, exp)
print("ALL PASS" if ok else "SOME FAILED")
sys.exit(0 if ok else 1)
