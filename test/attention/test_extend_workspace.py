"""The prefill path's FlashInfer workspace is reserved while SGLang profiles the KV budget (so
the pool is sized with it counted), never allocated mid-serving; a failed reservation turns
only the HOT prefill path off."""

from types import SimpleNamespace

import pytest
import torch

from granikv import plugin
from granikv.config import GraniKVConfig
from granikv.attention.extend import workspace as extend_workspace
from granikv.attention.backend import GraniKVAttnBackend

import test_backend as tb  # noqa: E402  (beside this file)


def test_reserve_once_and_fail_cleanly(caplog):
    holder = SimpleNamespace()
    assert extend_workspace.reserve(holder, "cpu", 4096) == 4096
    res = extend_workspace.reservation_of(SimpleNamespace(model=holder))
    assert res.buffer.numel() == 4096 and res.buffer.dtype == torch.uint8 and res.off_reason is None
    assert extend_workspace.reserve(holder, "cpu", 4096) == 0  # profiled again: nothing new
    broke = SimpleNamespace()
    with caplog.at_level("ERROR", logger="granikv"):
        assert extend_workspace.reserve(broke, "cpu", 1 << 62) == 0  # the allocator refuses
    assert extend_workspace.reservation_of(SimpleNamespace(model=broke)).buffer is None
    assert "prefill over HOT prefixes is off" in caplog.text
    assert extend_workspace.reservation_of(SimpleNamespace()) is None


def _configurator(prefill, device="cuda", **cfg):
    sa = SimpleNamespace(_granikv=GraniKVConfig(enable=True, **cfg),
                         get_attention_backends=lambda: (prefill, prefill))
    return SimpleNamespace(server_args=sa, is_draft_worker=False, device=device, gpu_id=0,
                           model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("prefill, device, cfg, expect", [
    ("flashinfer", "cuda", {}, None),  # the flashinfer backend's own workspace is shared
    ("triton", "cpu", {}, None),  # no GPU: nothing to reserve
    ("triton", "cuda", {"extend_path": "paged"}, None),  # the HOT prefill path is off anyway
    ("triton", "cuda", {}, 10_000 - 4096),
])
def test_profile_hook_takes_the_workspace_off_the_kv_budget(monkeypatch, prefill, device, cfg, expect):
    real = extend_workspace.reserve
    monkeypatch.setattr(extend_workspace, "reserve", lambda holder, dev: real(holder, "cpu", 4096))
    conf = _configurator(prefill, device, **cfg)
    assert plugin._after_profile_available_bytes(10_000, conf, 123) == expect
    assert (getattr(conf.model, "_granikv_extend_workspace", None) is not None) == (expect is not None)
    if expect is not None:  # the workspace is no parameter or buffer of the model
        assert list(conf.model.state_dict()) == ["weight", "bias"]


def _cuda_backend(runner, inner):
    """A backend on a 'cuda' runner (nothing is allocated at construction, so this runs on CPU)."""
    runner.device = "cuda"
    return GraniKVAttnBackend(inner, model_runner=runner, cfg=GraniKVConfig(enable=True),
                              backend_name="triton")


def test_backend_uses_the_reservation_or_keeps_prefill_stock(caplog):
    runner = tb._runner()
    with caplog.at_level("WARNING", logger="granikv"):
        be = _cuda_backend(runner, SimpleNamespace())
    assert be.extend.off_reason == "no FlashInfer workspace reserved at startup"
    assert "prefill over HOT prefixes is off under triton" in caplog.text
    runner.model = torch.nn.Linear(2, 2)
    extend_workspace.reserve(runner.model, "cpu", 4096)
    be = _cuda_backend(runner, SimpleNamespace())
    assert be.extend.off_reason is None
    assert be.extend.workspace_buffer() is runner.model._granikv_extend_workspace.buffer
    own = torch.empty(8, dtype=torch.uint8)
    be = _cuda_backend(tb._runner(), SimpleNamespace(workspace_buffer=own))  # flashinfer: its own
    assert be.extend.off_reason is None and be.extend.workspace_buffer() is own
    failed = tb._runner()
    failed.model = torch.nn.Linear(2, 2)
    extend_workspace.reserve(failed.model, "cpu", 1 << 62)
    assert "no memory" in _cuda_backend(failed, SimpleNamespace()).extend.off_reason
