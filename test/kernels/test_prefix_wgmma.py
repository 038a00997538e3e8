"""CPU checks of the Gluon sm90 prefix kernel (``prefix_kernel="wgmma"``): the launch's contract
(what it refuses and how it says so) and the kernel compiled for sm90 by the installed Triton
(Gluon kernels do not run in Triton's interpreter; their numerics are checked on the GPU host,
test_gpu_prefix_wgmma.py). The compiled PTX must hold what the kernel is for: TMA tile loads,
asynchronous warp-group MMAs, and (with the MMA overlap) a wait that leaves one MMA in flight.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import fill, make_batch

from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels import prefix_wgmma, prefix_wgmma_ws
from granikv.kernels.kernel_config import PREFIX_KERNELS, KernelConfig, tile_config
from granikv.kernels.prefix_attention import prefix_attention

needs_gluon = pytest.mark.skipif(prefix_wgmma.gluon is None, reason=f"no Gluon: {prefix_wgmma.GLUON_ERROR}")


def test_config_takes_wgmma_and_names_the_choices():
    assert "wgmma" in PREFIX_KERNELS
    assert KernelConfig(prefix_kernel="wgmma").prefix_mma_overlap
    with pytest.raises(ValueError, match="prefix_kernel='tma'.*pointer, descriptor, wgmma, auto"):
        KernelConfig(prefix_kernel="tma")


def test_auto_takes_wgmma_only_where_it_can_run(monkeypatch):
    """``prefix_kernel="auto"`` (``auto_prefix_kernel``): the wgmma kernel where its checks pass
    (here: a device it is told is sm90), descriptor loads where they do not (this CPU, a block_m
    it has no warpgroups for, one stage), pointer loads over an FP8 cache or a strided buffer;
    ``tile_config`` with TMA holds the query in registers."""
    from granikv.kernels import prefix_attention as pa

    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(100, 8, 128, dtype=torch.bfloat16)
    cfg = tile_config(4, 128, tma=True)
    assert cfg.prefix_kernel == "auto" and cfg.prefix_q_registers and not tile_config(4, 128).prefix_q_registers
    pa._wgmma_serves.cache_clear()
    assert pa.auto_prefix_kernel(q, kv, kv, cfg) == "descriptor"  # not an sm90 device
    monkeypatch.setattr(prefix_wgmma, "wgmma_unfit_for", lambda device, qd, kd, hd, bm: "" if bm in (64, 128) else "x")
    pa._wgmma_serves.cache_clear()
    assert pa.auto_prefix_kernel(q, kv, kv, cfg) == "wgmma"
    assert pa.auto_prefix_kernel(q, kv, kv, replace(cfg, block_m=32)) == "descriptor"
    assert pa.auto_prefix_kernel(q, kv, kv, replace(cfg, prefix_stages=1)) == "descriptor"
    assert pa.auto_prefix_kernel(q, kv, kv, replace(cfg, block_m=64, prefix_warp_specialize=True)) == "descriptor"
    fp8 = kv.to(torch.float8_e4m3fn)
    assert pa.auto_prefix_kernel(q, fp8, fp8, cfg) == "pointer"
    assert pa.auto_prefix_kernel(q, kv[:, :4], kv[:, :4], cfg) == "pointer"
    pa._wgmma_serves.cache_clear()


def test_auto_falls_back_to_descriptors_when_the_wgmma_kernel_cannot_be_built(monkeypatch, caplog):
    """A Triton whose Gluon cannot build the kernel: under "auto" the step runs the descriptor
    kernel (same partial rows), one warning names the error, and later steps do not try again;
    ``prefix_kernel="wgmma"`` named explicitly still raises."""
    from granikv.kernels import prefix_attention as pa

    b = make_batch(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("this Gluon has no warpgroup_mma")

    monkeypatch.setattr(prefix_wgmma, "prefix_wgmma_attention", broken)
    monkeypatch.setattr(pa, "_WGMMA_FAILED", [])
    monkeypatch.setattr(pa, "auto_prefix_kernel", lambda q, k, v, cfg: "wgmma" if not pa._WGMMA_FAILED else "descriptor")
    parts = []
    for kind in ("auto", "descriptor", "auto"):
        ws = CascadeWorkspace(16, 8, 2, 64, "cpu", config=replace(tile_config(4, 64), prefix_kernel=kind))
        fill(ws, b)
        ws.part_o.fill_(float("nan"))
        with caplog.at_level("WARNING", logger="granikv"):
            prefix_attention(b.q, b.k, b.v, ws.plan, sm_scale=b.sm_scale)
        parts.append(ws.part_o.clone())
    assert len(calls) == 1 and pa._WGMMA_FAILED and "no warpgroup_mma" in pa._WGMMA_FAILED[0]
    assert torch.equal(parts[0].nan_to_num(7.0), parts[1].nan_to_num(7.0))
    warnings = [r.getMessage() for r in caplog.records if "wgmma prefix kernel could not run" in r.getMessage()]
    assert len(warnings) == 1 and "descriptor" in warnings[0]
    ws = CascadeWorkspace(16, 8, 2, 64, "cpu", config=replace(tile_config(4, 64), prefix_kernel="wgmma"))
    fill(ws, b)
    with pytest.raises(RuntimeError, match="no warpgroup_mma"):
        prefix_attention(b.q, b.k, b.v, ws.plan, sm_scale=b.sm_scale)
    # the real "auto" check: no wgmma once it failed, whatever the device says
    monkeypatch.setattr(prefix_wgmma, "wgmma_unfit_for", lambda *a: "")
    pa._wgmma_serves.cache_clear()
    assert not pa._wgmma_serves(torch.device("cpu"), torch.float16, torch.float16, torch.float16, 64, 64, 3, False)
    monkeypatch.setattr(pa, "_WGMMA_FAILED", [])
    pa._wgmma_serves.cache_clear()
    assert pa._wgmma_serves(torch.device("cpu"), torch.float16, torch.float16, torch.float16, 64, 64, 3, False)
    pa._wgmma_serves.cache_clear()


def test_unfit_reasons_name_what_does_not_fit():
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(100, 8, 128, dtype=torch.bfloat16)
    why = prefix_wgmma.wgmma_unfit_reason(q, kv, kv, 64)
    assert why and ("sm90" in why or "Gluon" in why)
    assert not prefix_wgmma.wgmma_fits(q, kv, kv, 64)


def test_prefix_attention_refuses_wgmma_off_sm90():
    b = make_batch(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    cfg = replace(tile_config(4, 64), prefix_kernel="wgmma")
    ws = CascadeWorkspace(16, 8, 2, 64, "cpu", config=cfg)
    fill(ws, b)
    with pytest.raises(ValueError, match="prefix_kernel='wgmma' cannot run here"):
        prefix_attention(b.q, b.k, b.v, ws.plan, sm_scale=b.sm_scale)


def _compile_sm90(configs) -> list:
    """PTX features of the kernel compiled for sm90 by the installed Triton (no GPU needed), one
    dict per (block_m, block_n, head_dim, stages, overlap) config. In a child process: this
    test run has ``TRITON_INTERPRET=1`` set (conftest), which makes every ``jit`` function
    Triton defines at import (its reductions' combine functions too) an interpreted one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "python"), str(root / "test"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "support.compile_sm90", json.dumps(configs)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("block_m,block_n,head_dim,stages,overlap",
                         [(64, 64, 128, 3, True), (64, 64, 128, 3, False), (128, 64, 128, 2, True),
                          (64, 128, 64, 2, True), (64, 64, 64, 4, True), (64, 32, 128, 3, True)])
def test_kernel_compiles_for_sm90(block_m, block_n, head_dim, stages, overlap):
    (ptx,) = _compile_sm90([[block_m, block_n, head_dim, stages, overlap, 3]])
    assert ptx["tma_loads"]  # K/V tiles by TMA
    assert f"m64n{block_n}k16" in ptx["wgmma_shapes"]  # S = Q K^T
    assert f"m64n{head_dim}k16" in ptx["wgmma_shapes"]  # O += P V
    assert ptx["waits_leaving_one"] == overlap  # P V left in flight under the next scores
    assert ptx["spills"] == 0
    if block_n != head_dim:  # else P V's register MMA has the same shape
        assert f"m64n{block_n}k16" not in ptx["register_a_shapes"]  # Q read from shared memory


@needs_gluon
@pytest.mark.parametrize("block_n,stages", [(64, 3), (64, 2), (32, 4)])
def test_query_in_registers_compiles_for_sm90(block_n, stages):
    """``prefix_q_registers``: S = Q K^T takes its A operand from registers (P V always does), with
    the overlap and no spills."""
    (ptx,) = _compile_sm90([[64, block_n, 128, stages, True, 4, False, True]])
    assert ptx["tma_loads"] and ptx["waits_leaving_one"]
    assert {f"m64n{block_n}k16", "m64n128k16"} <= set(ptx["register_a_shapes"])
    assert ptx["spills"] == 0


@needs_gluon
@pytest.mark.parametrize("head_dim,ratio,sinks", [(128, 4, False), (64, 8, True)])
def test_arrival_epilogue_compiles_for_sm90(head_dim, ratio, sinks):
    """``KernelConfig.merge_in_kernels``: the kernel counts its rows' arrivals with acquire-release
    atomics at GPU scope (and only with it), keeps its TMA loads and overlapped MMAs, no spills."""
    with_arrival, without = _compile_sm90([[64, 64, head_dim, 3, True, ratio, False, True, True, sinks],
                                           [64, 64, head_dim, 3, True, ratio, False, True, False, False]])
    assert with_arrival["atomics"] == ["atom.global.gpu.acq_rel.add.u32"] and without["atomics"] == []
    assert with_arrival["tma_loads"] and with_arrival["waits_leaving_one"]
    assert with_arrival["wgmma_shapes"] == without["wgmma_shapes"]
    assert with_arrival["spills"] == 0


def test_arrival_merge_refuses_the_warp_specialized_kernel():
    with pytest.raises(ValueError, match="merge_in_kernels needs a prefix kernel with the arrival epilogue"):
        KernelConfig(prefix_kernel="wgmma", prefix_warp_specialize=True, block_m=128, merge_in_kernels=True)
    KernelConfig(prefix_kernel="descriptor", prefix_warp_specialize=True, merge_in_kernels=True)  # has it


@needs_gluon
@pytest.mark.parametrize("block_n,head_dim,stages", [(64, 128, 3), (64, 64, 4), (64, 128, 2)])
def test_warp_specialized_kernel_compiles_for_sm90(block_n, head_dim, stages):
    """The producer / two-consumer kernel: TMA loads, both MMA shapes with one left in flight,
    the registers split between the partitions (the producer's budget and the consumers'), and
    no spills at that split."""
    (ptx,) = _compile_sm90([[128, block_n, head_dim, stages, True, 4, True]])
    assert ptx["tma_loads"] and ptx["waits_leaving_one"]
    assert {f"m64n{block_n}k16", f"m64n{head_dim}k16"} <= set(ptx["wgmma_shapes"])
    assert {str(prefix_wgmma_ws.WS_CONSUMER_REGS), str(prefix_wgmma_ws.WS_PRODUCER_REGS)} <= set(ptx["register_splits"])
    assert ptx["spills"] is not None and ptx["spills"] <= 64  # ptxas: 16-32 bytes (Triton 3.6 / 3.8)


def test_warp_specialized_launch_refuses_other_row_tiles_and_one_stage():
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(100, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="prefix_kernel='wgmma' cannot run here"):
        prefix_wgmma.prefix_wgmma_attention(q, kv, kv, None, scale=1.0, block_m=64, block_n=64, stages=3,
                                            overlap=True, warp_specialize=True)
