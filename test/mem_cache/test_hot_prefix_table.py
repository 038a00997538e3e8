import numpy as np
import pytest
import torch

from granikv.mem_cache.hot_pool import IntegrityError
from granikv.mem_cache.hot_prefix_table import HotPrefixTable


def test_set_clear_set_many_keep_device_and_mirror_equal():
    t = HotPrefixTable(9, "cpu")
    t.set(3, 100, 17)
    t.set_many([1, 5, 8], [7, 9, 11], [2, 0, 37])
    assert t.get(3) == (100, 17) and t.get(5) == (0, 0) and t.get(8) == (11, 37)
    assert t.start_dev.dtype == torch.int32 and t.start_np.dtype == np.int64
    t.check_integrity()
    t.clear(3)
    assert t.get(3) == (0, 0)
    assert torch.equal(t.length_dev, torch.tensor([0, 2, 0, 0, 0, 0, 0, 0, 37], dtype=torch.int32))
    t.reset()
    assert not t.length_np.any() and not t.length_dev.any()


def test_padding_row_is_protected():
    t = HotPrefixTable(4, "cpu")
    with pytest.raises(ValueError, match="rows"):
        t.set(0, 1, 1)
    with pytest.raises(ValueError, match="rows"):
        t.set(4, 1, 1)


def test_integrity_detects_divergence():
    t = HotPrefixTable(4, "cpu")
    t.set(2, 5, 6)
    t.start_dev[2] = 9
    with pytest.raises(IntegrityError, match="start_dev"):
        t.check_integrity()
