"""Torch references (float64 math) for the cascade kernels. Slow, exact, for tests only.

Each mirrors a kernel's contract: ``attend_ref`` is the primitive (one query set, one key set),
the others map it over requests / work items. LSE is the natural log of the sum of
exp(scaled scores); an empty key set gives o = 0, lse = -inf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from granikv.attention.decode.work_list import WorkList

__all__ = [
    "AttentionState",
    "attend_ref",
    "decode_attention_ref",
    "prefix_attention_ref",
    "suffix_attention_ref",
    "merge_state_ref",
    "with_sinks_ref",
    "dequantize_ref",
    "partials_ref",
]


class AttentionState(NamedTuple):
    o: torch.Tensor  # float64 [..., Hq, D]
    lse: torch.Tensor  # float64 [..., Hq]


IntVector = Union[torch.Tensor, np.ndarray, Sequence[int]]  # per request / group ints: device, host or a list


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> AttentionState:
    """q [Hq, D], k/v [n, Hkv, D] -> o [Hq, D], lse [Hq] (float64, on q's device); GQA: q-head j
    uses kv head j // (Hq // Hkv)."""
    hq, d = q.shape
    if k.shape[0] == 0:
        z = torch.zeros(hq, d, dtype=torch.float64, device=q.device)
        return AttentionState(z, torch.full((hq,), float("-inf"), dtype=torch.float64, device=q.device))
    hkv = k.shape[1]
    qg = q.double().view(hkv, hq // hkv, d)
    s = torch.einsum("grd,ngd->grn", qg, k.double()) * sm_scale
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("grn,ngd->grd", torch.exp(s - lse[..., None]), v.double())
    return AttentionState(o.reshape(hq, d), lse.reshape(hq))


def _stack(states: Sequence[AttentionState]) -> AttentionState:
    return AttentionState(torch.stack([s.o for s in states]), torch.stack([s.lse for s in states]))


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: IntVector, seq_lens: IntVector, sm_scale: float,
                         sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> AttentionState:
    """Plain paged decode: request i attends to slots req_to_token[rpi[i], :seq_lens[i]];
    ``sinks`` [Hq]: attention-sink logits (``with_sinks_ref``); ``k_scale`` / ``v_scale``: the
    buffers' dequantization scales (an FP8 cache: ``dequantize_ref`` of the gathered slots)."""
    st = suffix_attention_ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                              [0] * q.shape[0], sm_scale, k_scale=k_scale, v_scale=v_scale)
    return st if sinks is None else with_sinks_ref(st, sinks)


def dequantize_ref(buf: torch.Tensor, scale: float) -> torch.Tensor:
    """An FP8 (or any) KV buffer as float64 values: the stored numbers times the layer's scale,
    the dequantization SGLang's backends apply to the same bytes (``kv_scales``)."""
    return buf.double() * scale


def with_sinks_ref(state: AttentionState, sinks: torch.Tensor) -> AttentionState:
    """Attention whose softmax denominator also holds ``exp(sinks[j])`` per q-head j (a logit
    that attends to nothing, as gpt-oss's learned sinks): o * exp(lse) / (exp(lse) +
    exp(sink)), lse = logaddexp(lse, sink). An empty state (lse = -inf) stays o = 0."""
    sink = sinks.double().to(state.lse.device)
    lse = torch.logaddexp(state.lse, sink.expand_as(state.lse))
    scale = torch.exp(state.lse - lse)  # exp(-inf) = 0
    return AttentionState(state.o * scale[..., None], lse)


def prefix_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, group_start: IntVector,
                         group_len: IntVector, group_req_indptr: IntVector, group_req_idx: IntVector,
                         sm_scale: float) -> AttentionState:
    """Per batch position: attention over its group's extent [start, start+len); -inf if ungrouped."""
    empty = k_buffer[:0]
    states = [attend_ref(q[i], empty, empty, sm_scale) for i in range(q.shape[0])]
    for g in range(len(group_start)):
        s, n = int(group_start[g]), int(group_len[g])
        for i in group_req_idx[int(group_req_indptr[g]) : int(group_req_indptr[g + 1])]:
            states[int(i)] = attend_ref(q[int(i)], k_buffer[s : s + n], v_buffer[s : s + n], sm_scale)
    return _stack(states)


def suffix_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: IntVector, seq_lens: IntVector, prefix_len: IntVector,
                         sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> AttentionState:
    """Per batch position: attention over tokens [prefix_len[i], seq_lens[i]) via req_to_token
    (K / V dequantized by ``k_scale`` / ``v_scale`` after the gather)."""
    r2t = req_to_token.long()
    states = []
    for i in range(q.shape[0]):
        slots = r2t[int(req_pool_indices[i]), int(prefix_len[i]) : int(seq_lens[i])]
        k, v = dequantize_ref(k_buffer[slots], k_scale), dequantize_ref(v_buffer[slots], v_scale)
        states.append(attend_ref(q[i], k, v, sm_scale))
    return _stack(states)


def merge_state_ref(o: torch.Tensor, lse: torch.Tensor) -> AttentionState:
    """Merge states stacked on dim 0: o [P, ..., D], lse [P, ...] -> o [..., D], lse [...] (float64)."""
    o, lse = o.double(), lse.double()
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0
    s = w.sum(dim=0)
    out = (w[..., None] * o).sum(dim=0) / torch.where(s == 0, torch.ones_like(s), s)[..., None]
    return AttentionState(out, torch.log(s) + m_safe)


def partials_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: IntVector, work_list: WorkList, sm_scale: float) -> Dict[int, AttentionState]:
    """Expected partial state of every row a work list writes: {row: AttentionState [Hq, D]}.

    Prefix items: rows part_indptr[b] + split over slots [slot_lo, slot_lo + n_kv) for every
    member b with a flat row in [row_lo, row_hi) (all its q-heads: the items that share a
    member's row write disjoint heads of the same state); suffix items: row over tokens
    [t_lo, t_hi) of b's req_to_token row.
    """
    wl = work_list
    ratio = q.shape[1] // k_buffer.shape[1]
    r2t = req_to_token.long()
    rpi = np.asarray(req_pool_indices.cpu() if isinstance(req_pool_indices, torch.Tensor) else req_pool_indices)
    out: Dict[int, AttentionState] = {}
    for r_lo, r_hi, s0, n, sp in zip(wl.pfx_row_lo, wl.pfx_row_hi, wl.pfx_slot_lo, wl.pfx_n_kv, wl.pfx_split,
                                     strict=False):
        for b in wl.group_req_idx[r_lo // ratio : -(-r_hi // ratio)]:
            out[int(wl.part_indptr[b] + sp)] = attend_ref(q[b], k_buffer[s0 : s0 + n], v_buffer[s0 : s0 + n], sm_scale)
    for b, lo, hi, row in zip(wl.sfx_req, wl.sfx_lo, wl.sfx_hi, wl.sfx_row, strict=False):
        slots = r2t[int(rpi[b]), lo:hi]
        out[int(row)] = attend_ref(q[b], k_buffer[slots], v_buffer[slots], sm_scale)
    return out
