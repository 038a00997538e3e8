"""``ViewPlanMemo``: whether the wrapped backend's decode-graph metadata of a batch size still
holds this step's ``seq_len = 1`` view, so that a steady cascade step need not plan it again.

On a cascade graph step the wrapped backend is planned with the one-token view of the batch
(``batch_view.OneTokenView``); its kernels then write the step's K/V and read one token, and
GraniKV's kernels overwrite their output. What that plan writes (flashinfer: the indptr, the
slots ``req_to_token[row, 0]``, its host-side split plan; triton and fa3: the same lengths and
slots) is a function of the padded batch size, the requests' pool rows and their first KV slot,
and it lands in per-size buffers that only a metadata call of the wrapped backend rewrites. A
request's first slot moves only when a HOT promotion or compaction rewrites its row, which
publishes a new ``HotPrefixTable`` version. So while the steps of one batch keep their rows
(the planner's ``HeldRows``: same rows, same table version) and nothing else called the wrapped
backend in between, the last cascade step's plan is this step's, byte for byte: the call is
skipped (on flashinfer it is the host's largest per-step cost after SGLang's own).

The planner asks ``in_place(key)`` before each replay's wrapped-backend call (``key``: the
step's cascade view, None for a paged step over the real batch) and the backend calls
``forget()`` on every other call it makes to the wrapped backend (an extend, an eager step, a
capture, new graph state) and on the base-class metadata methods it forwards unchanged
(breakable prefill graphs, chunked-prefix graphs). ``--granikv-view-plan reuse`` (the default)
turns the reuse on; ``every_step`` plans the view on every step, as before the memo existed.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

ViewKey = Tuple[int, Any, Any]
"""(padded batch size, the planner's ``HeldRows`` object, its table version)."""


class ViewPlanMemo:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._key: Optional[ViewKey] = None  # the view the wrapped backend was last planned with
        self.reused = 0  # replays that found their view's plan in place
        self.planned = 0  # cascade replays that planned the wrapped backend

    def forget(self) -> None:
        """The wrapped backend was (or is about to be) called with something else."""
        self._key = None

    def in_place(self, key: Optional[ViewKey]) -> bool:
        """True when the wrapped backend's last plan was ``key``'s view (the caller skips the
        call); otherwise records ``key`` as the plan the caller now makes (None: not a view)."""
        last = self._key
        if (key is not None and last is not None and self.enabled
                and last[0] == key[0] and last[1] is key[1] and last[2] == key[2]):
            self.reused += 1
            return True
        self._key = key
        if key is not None:
            self.planned += 1
        return False

    def check_integrity(self) -> None:
        if not self.enabled and self.reused:
            raise AssertionError(f"view-plan reuse is off but {self.reused} replays reused a plan")
        if self._key is not None and (not isinstance(self._key[0], int) or self._key[0] < 1):
            raise AssertionError(f"view-plan key {self._key!r} has no batch size")
