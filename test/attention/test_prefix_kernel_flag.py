"""``--granikv-prefix-kernel``: the cascade workspaces' kernel config carries the named prefix
kernel ("auto" keeps ``tile_config``'s choice), and ``wgmma`` on a model or device it cannot
serve stops the server at startup with the flag and the reason (here: a CPU device, an FP8
cache, head_dim 256)."""

from types import SimpleNamespace

import pytest
import torch

from benchmark.kernels.bench_planning import _NoopBackend
from granikv.attention.backend import GraniKVAttnBackend
from granikv.config import GraniKVConfig
from granikv.kernels.kernel_config import tile_config
from granikv.kernels.prefix_wgmma import wgmma_unfit_for
from granikv.mem_cache.hot_prefix_table import HotPrefixTable


def _runner(head_dim=128, kv_dtype=torch.bfloat16):
    mc = SimpleNamespace(num_attention_heads=32, head_dim=head_dim, num_hidden_layers=2, context_len=32768,
                         get_num_kv_heads=lambda tp: 8, hf_config=SimpleNamespace())
    return SimpleNamespace(model_config=mc, ps=SimpleNamespace(attn_tp_size=1), device="cpu", kv_cache_dtype=kv_dtype,
                           dtype=torch.bfloat16, server_args=SimpleNamespace(speculative_algorithm=None),
                           token_to_kv_pool_allocator=SimpleNamespace(hot_prefix_table=HotPrefixTable(8)),
                           req_to_token_pool=None)


def _backend(runner, kind):
    cfg = GraniKVConfig(enable=True, log_interval=0, prefix_kernel=kind)
    return GraniKVAttnBackend(_NoopBackend(), model_runner=runner, cfg=cfg, backend_name="noop")


@pytest.mark.parametrize("kind", ["auto", "pointer", "descriptor"])
def test_workspaces_carry_the_named_prefix_kernel(kind):
    be = _backend(_runner(), kind)
    ws = be.decode.workspace_for(8)
    expected = tile_config(4, 128).prefix_kernel if kind == "auto" else kind
    assert ws.config.prefix_kernel == expected == be.decode.kernel_config().prefix_kernel


@pytest.mark.parametrize("runner,why", [(_runner(), "(sm90|Gluon)"),
                                        (_runner(kv_dtype=torch.float8_e4m3fn), "dtypes q torch.bfloat16, KV torch.float8_e4m3fn"),
                                        (_runner(head_dim=256), "head_dim 256")],
                         ids=["cpu", "fp8", "head_dim256"])
def test_wgmma_on_a_model_or_device_it_cannot_serve_stops_startup_naming_the_flag(runner, why):
    with pytest.raises(ValueError, match=rf"--granikv-prefix-kernel=wgmma cannot run here: .*{why}"):
        _backend(runner, "wgmma")


def test_wgmma_fit_on_the_gpu_host():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("an sm90 GPU")
    assert wgmma_unfit_for("cuda", torch.bfloat16, torch.bfloat16, 128) == ""


def test_the_flag_offers_the_kernel_configs_prefix_kernels():
    from typing import get_args

    from granikv.config import PrefixKernel
    from granikv.kernels.kernel_config import PREFIX_KERNELS

    assert set(get_args(PrefixKernel)) == set(PREFIX_KERNELS)


def test_unknown_prefix_kernel_is_refused_with_its_choices():
    with pytest.raises(ValueError, match="--granikv-prefix-kernel='tma' is not one of auto, pointer, descriptor, wgmma"):
        GraniKVConfig(enable=True, prefix_kernel="tma")


def test_launch_table_flag_loads_the_file_or_none(tmp_path):
    """``--granikv-launch-table``: its file's rules reach the workspaces (their capacity covers the
    widest target); ``off`` and a CPU device (no checked-in table) plan without one; a malformed
    file stops startup naming the flag, a missing one is refused by the config."""
    import json

    from granikv.attention.decode.launch_table import LaunchTable, rules_of

    table = LaunchTable(rules_of([(128, 64, 4096, 64, 3.0)]))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_mapping()))

    def backend(value):
        cfg = GraniKVConfig(enable=True, log_interval=0, launch_table=value)
        return GraniKVAttnBackend(_NoopBackend(), model_runner=_runner(), cfg=cfg, backend_name="noop")

    be = backend(str(path))
    assert be.decode.launch_table.rules == table.rules
    assert be.decode.workspace_for(8).launch_table is be.decode.launch_table
    assert backend("off").decode.launch_table is None and backend(None).decode.launch_table is None
    assert be.decode.workspace_for(8).prefix_cap > backend("off").decode.workspace_for(8).prefix_cap
    path.write_text("{")
    with pytest.raises(ValueError, match="--granikv-launch-table: launch table .*not JSON"):
        backend(str(path))
    with pytest.raises(ValueError, match="--granikv-launch-table='.*nope.json': no such file"):
        GraniKVConfig(launch_table=str(tmp_path / "nope.json"))
