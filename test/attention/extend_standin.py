"""CPU stand-ins for SGLang's flashinfer extend, shared by the prefill-path tests.

``FlashInferExtendStandIn`` is the ragged branch of ``FlashInferAttnBackend.forward_extend``
(flashinfer_backend.py:1324-1392 in SGLang 0.5.17): causal attention of the new tokens among
themselves, ``forward_metadata.prefill_wrappers[0].forward_return_lse`` for the cached prefix
(``PagedPrefixWrapperStandIn``: per request, through its ``req_to_token`` row), LSE merge, KV
write. SGLang's own backends need CUDA; these compute in float64 with base-2 LSE, as FlashInfer
returns it. Heads come from the runner's ``model_config``.
"""

import math
from types import SimpleNamespace

import torch

LN2 = math.log(2.0)


def attend(q, k, v, scale, first_pos=None):
    """float64 attention of q [n, Hq, D] over k, v [L, Hkv, D] (GQA by Hq / Hkv):
    ``(o [n, Hq, D], lse2 [n, Hq])``. With ``first_pos``, causal: token j of q is at position
    ``first_pos + j`` and sees k/v positions ``[0, first_pos + j]``."""
    ratio = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(ratio, 1), v.double().repeat_interleave(ratio, 1)
    s = torch.einsum("nhd,lhd->nhl", q.double(), kk) * scale
    if first_pos is not None:
        mask = torch.arange(k.shape[0])[None, :] > (first_pos + torch.arange(q.shape[0]))[:, None]
        s = s.masked_fill(mask[:, None, :], float("-inf"))
    return torch.einsum("nhl,lhd->nhd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1) / LN2


def merge(o1, s1, o2, s2):
    """LSE merge of two partial states (base-2 LSE)."""
    m = torch.maximum(s1, s2)
    w1, w2 = torch.exp2(s1 - m), torch.exp2(s2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


class PagedPrefixWrapperStandIn:
    """SGLang's paged prefill wrapper, planned for the batch: the prefix part per request."""

    def __init__(self, runner):
        self.runner, self.calls, self.fb = runner, 0, None

    def forward_return_lse(self, q, kv_cache, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=None):
        assert not causal
        self.calls += 1
        kb, vb = kv_cache
        rt = self.runner.req_to_token_pool.req_to_token
        o = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        t = 0
        for row, p, n in zip(self.fb.req_pool_indices.tolist(), self.fb.extend_prefix_lens_cpu,
                             self.fb.extend_seq_lens_cpu):
            if p:
                slots = rt[row, :p].long()
                o[t: t + n], lse[t: t + n] = attend(q[t: t + n], kb[slots], vb[slots], sm_scale)
            t += n
        return o.to(q.dtype), lse.float()


class FlashInferExtendStandIn:
    """The ragged branch of SGLang's flashinfer ``forward_extend`` (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        mc = runner.model_config
        self.hq, self.hkv, self.d = mc.num_attention_heads, mc.get_num_kv_heads(1), mc.head_dim
        self.paged = PagedPrefixWrapperStandIn(runner)
        self.prefill_wrappers_paged = [self.paged]  # the backend's persistent list

    def init_forward_metadata(self, fb):
        self.fb = self.paged.fb = fb
        self.forward_metadata = SimpleNamespace(prefill_wrappers=self.prefill_wrappers_paged, use_ragged=True,
                                                extend_no_prefix=not any(fb.extend_prefix_lens_cpu),
                                                multi_item_params=None)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        q3, k3, v3 = q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d), v.view(-1, self.hkv, self.d)
        o1, s1 = [], []
        t = 0
        for n in fb.extend_seq_lens_cpu:
            o, s = attend(q3[t: t + n], k3[t: t + n], v3[t: t + n], layer.scaling, first_pos=0)
            o1.append(o)
            s1.append(s)
            t += n
        o, s1 = torch.cat(o1), torch.cat(s1)
        pool = self.runner.token_to_kv_pool
        if not self.forward_metadata.extend_no_prefix:
            o2, s2 = self.forward_metadata.prefill_wrappers[0].forward_return_lse(
                q3, (pool.k_buffer[0], pool.v_buffer[0]), causal=False, sm_scale=layer.scaling)
            o = merge(o, s1, o2.double(), s2.double())
        if save_kv_cache:
            pool.k_buffer[0][fb.out_cache_loc] = k3
            pool.v_buffer[0][fb.out_cache_loc] = v3
        return o.to(q.dtype).view(-1, self.hq * self.d)


class TritonExtendStandIn:
    """SGLang's triton ``forward_extend`` (triton_backend.py:1250 in SGLang 0.5.17): writes the new
    tokens' K/V, then ONE causal attention per request over its whole ``req_to_token`` row (cached
    prefix + new tokens), no LSE. Its metadata has no prefill wrappers, so GraniKV cannot swap a
    prefix part and computes the whole extend itself (full_extend.py). Counts its calls."""

    def __init__(self, runner):
        self.runner = runner
        mc = runner.model_config
        self.hq, self.hkv, self.d = mc.num_attention_heads, mc.get_num_kv_heads(1), mc.head_dim
        self.calls = 0

    def init_forward_metadata(self, fb):
        self.fb = fb
        self.forward_metadata = SimpleNamespace(num_kv_splits=None)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        self.calls += 1
        pool = self.runner.token_to_kv_pool
        kb, vb = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
        kb[fb.out_cache_loc] = k.view(-1, self.hkv, self.d)  # what the kernel reads, written or not
        vb[fb.out_cache_loc] = v.view(-1, self.hkv, self.d)
        if save_kv_cache:
            pool.k_buffer[0].copy_(kb)
            pool.v_buffer[0].copy_(vb)
        rt = self.runner.req_to_token_pool.req_to_token
        outs, t = [], 0
        for row, p, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            slots = rt[row, : p + n].long()
            o, _ = attend(q.view(-1, self.hq, self.d)[t: t + n], kb[slots], vb[slots], layer.scaling, first_pos=p)
            outs.append(o)
            t += n
        return torch.cat(outs).to(q.dtype).view(-1, self.hq * self.d)
