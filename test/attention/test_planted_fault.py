"""The debug-only planted fault (GRANIKV_DEBUG_FAULT): off by default, a clear error for an
unknown name, and when set the decode output is wrong exactly where a group's prefix runs."""

import numpy as np
import pytest
import torch

from granikv import envs
from granikv.attention.debug import planted_fault
from test_backend import ATOL, LAYER, RTOL, _backend, _batch, _expected, _qkv, _runner  # noqa: E402


def test_from_name():
    assert planted_fault.from_name("") is planted_fault.NO_FAULT
    lens = np.array([37, 1, 8], dtype=np.int64)
    assert planted_fault.NO_FAULT.group_len(lens) is lens
    half = planted_fault.from_name("half_prefix").group_len(lens)
    assert half.tolist() == [18, 1, 4] and half.dtype == lens.dtype and lens.tolist() == [37, 1, 8]
    with pytest.raises(ValueError, match="GRANIKV_DEBUG_FAULT='shift'.*half_prefix"):
        planted_fault.from_name("shift")


@pytest.mark.parametrize("fault", ["", "half_prefix"])
def test_fault_breaks_grouped_rows_only(monkeypatch, fault):
    monkeypatch.setenv(envs.DEBUG_FAULT, fault)
    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={0, 2, 3})
    q, k, v = _qkv(fb.batch_size, 1)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    o = be.forward_decode(q, k, v, LAYER, fb)
    ref = _expected(runner, fb, q)
    grouped, private = [0, 2, 3], [1, 4]
    torch.testing.assert_close(o[private], ref[private], atol=ATOL, rtol=RTOL)
    if not fault:
        torch.testing.assert_close(o[grouped], ref[grouped], atol=ATOL, rtol=RTOL)
    else:  # every grouped row misses half its prefix: far outside the tolerance
        assert float((o[grouped].float() - ref[grouped].float()).abs().amax(1).min()) > 50 * ATOL
