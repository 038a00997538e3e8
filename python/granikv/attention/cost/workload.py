"""What one decode layer of a batch moves and computes on each attention path.

``HeadGeometry`` (one layer's attention shape on this rank) and ``Workload`` (bytes of KV,
FLOPs of the stacked prefix pass, groups): pure accounting, no hardware numbers.
``cost_model.CostModel`` turns a ``Workload`` into microseconds.
"""

from typing import NamedTuple


class HeadGeometry(NamedTuple):
    """Attention shape of one layer on this rank (after tensor parallelism)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token of one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def flops_per_query_token(self) -> int:
        """QK^T and PV for one request (all q heads) against one KV token: 2 GEMV of 2*D."""
        return 4 * self.num_q_heads * self.head_dim

    @property
    def state_bytes_per_request(self) -> int:
        """A partial state (fp32 o [Hq, D] + lse [Hq]), written once and read once."""
        return 2 * 4 * self.num_q_heads * (self.head_dim + 1)


class Workload(NamedTuple):
    """Bytes and FLOPs of ONE decode layer of a batch, per path (see the module docstring).

    - ``seq_bytes``: KV of every request's whole sequence (what a paged kernel reads).
    - ``reread_bytes``: part of ``seq_bytes`` that re-reads a group prefix another member of the
      group already read (``sum_g (size_g - 1) * len_g`` tokens).
    - ``prefix_bytes``: KV of each group prefix, once (``sum_g len_g`` tokens).
    - ``suffix_bytes``: KV outside group prefixes (``seq_bytes`` minus every member's prefix).
    - ``prefix_flops``: attention FLOPs of the stacked prefix pass.
    - ``state_bytes``: partial states of the prefix and suffix passes, written and read by the
      merge, plus the output.
    - ``num_groups``: work items of the prefix pass.
    """

    seq_bytes: float
    reread_bytes: float
    prefix_bytes: float
    suffix_bytes: float
    prefix_flops: float
    state_bytes: float
    num_groups: int
    batch_bytes: float = 0.0  # one token of KV per request: the wrapped backend's seq_len = 1 read

    @classmethod
    def from_sums(
        cls,
        geometry: HeadGeometry,
        *,
        batch_size: int,
        seq_tokens: int,
        prefix_tokens: int,
        stacked_prefix_tokens: int,
        num_grouped: int,
        num_groups: int,
    ) -> "Workload":
        """From token counts: ``seq_tokens = sum(seq_lens)``, ``prefix_tokens = sum_g len_g``,
        ``stacked_prefix_tokens = sum_g size_g * len_g``, ``num_grouped = sum_g size_g``."""
        g = geometry
        bpt = g.kv_bytes_per_token
        output = g.num_q_heads * g.head_dim * g.kv_dtype_bytes  # per request, written once
        state = g.state_bytes_per_request * (num_grouped + batch_size) + batch_size * output
        return cls(
            float(seq_tokens * bpt),
            float((stacked_prefix_tokens - prefix_tokens) * bpt),
            float(prefix_tokens * bpt),
            float((seq_tokens - stacked_prefix_tokens) * bpt),
            float(stacked_prefix_tokens * g.flops_per_query_token),
            float(state),
            num_groups,
            float(batch_size * bpt),
        )
