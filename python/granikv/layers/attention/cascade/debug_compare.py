"""``DebugCompare``: ``--granikv-debug-compare-every N`` checks of GraniKV's attention against a
reference on live batches, logged and kept in ``StepStats``.

- decode: every N-th step, layer 0's output of the chosen path against the float64 torch
  reference of paged attention (eager steps only: a graph replay runs no Python);
- extend through proxies (flashinfer): every N-th HOT extend batch, layer 0's dense prefix part
  against the stock paged one (same batch, same KV);
- full extend (other backends): every N-th HOT extend batch, layer 0's whole extend output
  against the wrapped backend's (it reads the K/V just written, and writes nothing).

``host``: the ``GraniKVAttnBackend`` compared; ``cfg``, ``stats``, ``inner`` and
``model_runner`` are read from it at each call (they may be replaced after construction).
"""

import logging

import numpy as np
import torch

logger = logging.getLogger("granikv")


class DebugCompare:
    def __init__(self, host):
        self.host = host

    # ---- decode ----------------------------------------------------------------------------

    def decode_due(self, layer) -> bool:
        n = self.host.cfg.debug_compare_every
        capturing = torch.cuda.is_current_stream_capturing() if torch.cuda.is_available() else False
        return bool(n) and layer.layer_id == 0 and not capturing and self.host.stats.steps % n == 0

    def compare_decode(self, q, layer, fb, o, path) -> None:
        """The chosen ``path``'s output ``o`` against the float64 reference of paged attention."""
        from granikv.kernels.reference import decode_attention_ref

        host = self.host
        runner = host.model_runner
        pool = runner.token_to_kv_pool
        hq, d = host.num_q_heads, host.head_dim
        bs = fb.batch_size - int(getattr(fb, "num_padding", 0) or 0)
        ref = decode_attention_ref(q.view(-1, hq, d)[:bs],
                                   pool.get_key_buffer(layer.layer_id),
                                   pool.get_value_buffer(layer.layer_id),
                                   runner.req_to_token_pool.req_to_token,
                                   fb.req_pool_indices[:bs], fb.seq_lens[:bs], layer.scaling)
        diff = (o.view(-1, hq, d)[:bs].double() - ref.o).abs().max()
        host.stats.max_compare_diff = max(host.stats.max_compare_diff, float(diff))
        logger.info("GraniKV debug compare (step %d, %s, bs %d): max |diff| vs paged = %.3e",
                    host.stats.steps, path.value, bs, float(diff))

    # ---- extend ----------------------------------------------------------------------------

    def extend_due(self) -> bool:
        """Every N-th HOT extend batch (the one just recorded)."""
        n = self.host.cfg.debug_compare_every
        return bool(n) and (self.host.stats.extend_hot_batches - 1) % n == 0

    def prefix_part_callback(self, plan):
        """The proxies' ``on_compare``: layer 0's dense prefix part against the stock paged one."""
        stats = self.host.stats

        def compare(ours, stock):
            parts = [g.token_idx for g in plan.groups] + ([plan.paged.token_idx] if plan.paged else [])
            rows = torch.from_numpy(np.unique(np.concatenate(parts))).to(ours[0].device)
            d_o = (ours[0].index_select(0, rows).float() - stock[0].index_select(0, rows).float()).abs().max()
            d_l = (ours[1].index_select(0, rows) - stock[1].index_select(0, rows)).abs().max()
            diff = max(float(d_o), float(d_l))
            stats.max_extend_compare_diff = max(stats.max_extend_compare_diff, diff)
            logger.info("GraniKV debug compare (extend batch %d, %d HOT tokens, %d groups): max |diff| "
                        "vs paged prefill: o %.3e, lse %.3e", stats.extend_hot_batches,
                        plan.hot_tokens, len(plan.groups), float(d_o), float(d_l))
        return compare

    def compare_full_extend(self, ours, q, k, v, layer, fb, kwargs, *, hot_tokens: int) -> None:
        """Layer 0's extend output ``ours`` against the wrapped backend's."""
        host = self.host
        stock = host.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=False, **kwargs)
        diff = float((ours.float() - stock.float()).abs().max())
        scale = float(stock.float().abs().max())  # dummy weights give tiny outputs: say how tiny
        host.stats.max_extend_compare_diff = max(host.stats.max_extend_compare_diff, diff)
        logger.info("GraniKV debug compare (extend batch %d, %d HOT tokens): max |diff| vs the %s "
                    "backend's extend: o %.3e (max |o| %.3e)", host.stats.extend_hot_batches,
                    hot_tokens, host.backend_name, diff, scale)
