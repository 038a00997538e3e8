"""Random decode batches with shared HOT prefixes, for the kernel tests.

Slot space of a batch (page size 1):

    0 | group 0 extent | group 1 extent | ... | COLD slots (suffixes, ungrouped requests), shuffled
    ^ padding slot

Batch order interleaves group members and ungrouped requests; request-pool rows are shuffled.
"""

from types import SimpleNamespace

import numpy as np
import torch

from granikv.attention.decode.work_list import KernelConfig
from granikv.kernels.plan import Grouping

# Small tiles so the interpreter stays fast and every path (several tiles per group, several
# kv chunks per group, several suffix chunks per request, masked tails) is exercised.
SMALL_CONFIG = KernelConfig(
    block_m=16, block_n=16, prefix_warps=4, suffix_block_n=16, prefix_waves=1.0, suffix_waves=1.0,
    min_prefix_chunk=16, min_suffix_chunk=16,
)  # fmt: skip


def make_batch(*, groups=((37, 1), (37, 2), (37, 5)), n_ungrouped=3, suffix=17, ungrouped_len=54, num_q_heads=8,
               num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu", seed=0, max_ctx=None):
    """groups: (prefix_len, n_requests) per group. Suffix lengths vary around ``suffix`` (>= 1)."""
    rng = np.random.default_rng(seed)
    n_grouped = sum(n for _, n in groups)
    bs = n_grouped + n_ungrouped
    pre = [lp for lp, _ in groups]
    suf = np.maximum(1, suffix + rng.integers(-suffix // 2, suffix // 2 + 1, size=bs))
    g_of = np.concatenate([np.full(n, g) for g, (_, n) in enumerate(groups)] + [np.full(n_ungrouped, -1)]).astype(int)
    perm = rng.permutation(bs)  # batch position of the k-th request above
    prefix_len = np.zeros(bs, np.int64)
    seq_lens = np.zeros(bs, np.int64)
    g_start = np.cumsum([1] + pre[:-1]) if groups else np.zeros(0, np.int64)
    n_cold = int(suf.sum() + n_ungrouped * ungrouped_len)
    total_slots = 1 + sum(pre) + n_cold + 5
    cold = (1 + sum(pre) + rng.permutation(n_cold + 5))[:n_cold]
    max_ctx = max_ctx or (max(pre + [ungrouped_len]) + int(suf.max()) + 3)
    r2t = np.zeros((bs + 2, max_ctx), np.int32)
    rpi = rng.permutation(np.arange(1, bs + 2))[:bs]
    members = [[] for _ in groups]
    c = 0
    for k in range(bs):
        i, g = perm[k], g_of[k]
        if g >= 0:
            lp, ls = pre[g], int(suf[k])
            row = np.concatenate([g_start[g] + np.arange(lp), cold[c : c + ls]])
            c += ls
            prefix_len[i] = lp
            members[g].append(i)
        else:
            row = cold[c : c + ungrouped_len]
            c += ungrouped_len
        seq_lens[i] = len(row)
        r2t[rpi[i], : len(row)] = row
    indptr = np.cumsum([0] + [len(m) for m in members])
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    return SimpleNamespace(
        q=rnd(bs, num_q_heads, head_dim),
        k=rnd(total_slots, num_kv_heads, head_dim),
        v=rnd(total_slots, num_kv_heads, head_dim),
        req_to_token=torch.from_numpy(r2t).to(device),
        req_pool_indices=rpi.astype(np.int64),
        seq_lens=seq_lens,
        prefix_len=prefix_len,
        group_start=np.asarray(g_start, np.int64),
        group_len=np.asarray(pre, np.int64),
        group_req_indptr=indptr.astype(np.int64),
        group_req_idx=np.asarray([i for m in members for i in m], np.int64),
        sm_scale=head_dim**-0.5,
        bs=bs,
    )


def fill(ws, b, **kw):
    return ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), b.seq_lens,
                   b.req_pool_indices, **kw)  # fmt: skip
