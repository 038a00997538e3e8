"""bench_extend.py (GPU-only) imports on CPU and its cases are well formed, so a device call is
never lost to a typo in the script."""

from bench_scripts import load  # noqa: E402  (test/benchmark, on the path)


def test_bench_extend_imports_and_cases_are_valid():
    mod = load("kernels", "bench_extend.py")
    assert mod.HQ % mod.HKV == 0
    for prefix, agents, new in mod.CASES:
        assert prefix > 0 and agents > 0 and new > 0
    assert (16384, 64, 256) in mod.CASES  # the end-to-end row it is meant to explain


def test_bench_extend_has_decode_cases_for_the_split_variants():
    mod = load("kernels", "bench_extend.py")
    few = [c for c in mod.CASES if c[1] * c[2] <= mod.FEW_TOKENS]
    assert few and all(new == 1 for _, _, new in few)  # decode-shaped cases get the split variants
    assert all(s >= 2 for s in mod.SPLITS)


def _load():
    return load("kernels", "bench_extend.py")


def _attend_ref(rows, k, v, qo_ptr, kv_ptr):
    """The ragged MHA batch in float64 torch: entry s = rows [qo_ptr[s], qo_ptr[s+1]) against
    keys [kv_ptr[s], kv_ptr[s+1]); natural-log LSE."""
    import torch

    outs, lses = [], []
    for s in range(len(qo_ptr) - 1):
        q = rows[qo_ptr[s]:qo_ptr[s + 1]].double()
        kk, vv = k[kv_ptr[s]:kv_ptr[s + 1]].double(), v[kv_ptr[s]:kv_ptr[s + 1]].double()
        logits = torch.einsum("mhd,lhd->mhl", q, kk) / q.shape[-1] ** 0.5
        lse = torch.logsumexp(logits, -1)
        outs.append(torch.einsum("mhl,lhd->mhd", torch.softmax(logits, -1), vv))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _merge_ref(o, lse):
    """[m, S, h, d], [m, S, h] -> [m, h, d], [m, h] (natural log)."""
    import torch

    total = torch.logsumexp(lse, 1)
    w = torch.exp(lse - total[:, None])
    return (o * w[..., None]).sum(1), total


def test_packed_gqa_split_attention_equals_gqa_attention():
    """The decode variant's math (pack GQA heads as rows, split the keys, merge, unpack) against
    plain GQA attention, float64 on CPU: exact to rounding."""
    import torch

    mod = _load()
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d, length = 5, 8, 2, 16, 37
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(length, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(length, hkv, d, generator=g, dtype=torch.float64)
    r = hq // hkv
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)  # q head h reads kv head h // r
    logits = torch.einsum("nhd,lhd->nhl", q, kk) / d**0.5
    ref_o = torch.einsum("nhl,lhd->nhd", torch.softmax(logits, -1), vv)
    ref_lse = torch.logsumexp(logits, -1)
    assert torch.equal(mod.unpack_gqa(mod.pack_gqa(q, hkv), mod.pack_gqa(q, hkv)[..., 0], hq)[0], q)
    for n_split in (1, 3, 4):
        o, lse = mod.mha_split_attention(q, k, v, n_split, _attend_ref, _merge_ref)
        assert o.shape == (n, hq, d) and lse.shape == (n, hq)
        torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    assert mod.split_ptrs(37, 4) == [0, 10, 20, 30, 37] and mod.split_ptrs(8, 16)[-1] == 8


def test_forest_batch_plans_into_two_calls(monkeypatch):
    """--forest: the batch (built on CPU here) is a forest of 16 extents whose plan is one call
    for the disjoint extents plus one for the head-only matches."""
    from granikv.attention.extend.plan import plan_extend
    from granikv.attention.extend.hot_extend import check_call

    mod = _load()
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "DT", __import__("torch").float16)
    k, v, rows, prefix, start, length, new, r2t, q = mod.forest_batch()
    plan, reason = plan_extend(rows, prefix, new, start, length)
    assert reason == "" and len(plan.groups) > 16 and len(plan.calls) == 2
    for c in plan.calls:
        check_call(c, plan.groups)
    assert q.shape[0] == plan.num_tokens == plan.hot_tokens
