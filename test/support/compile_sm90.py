"""Compiles the Gluon sm90 prefix kernel for sm90 with the installed Triton (no GPU needed) and
prints, as one JSON line, what its PTX holds per config: TMA tile loads, the warp-group MMA
shapes, whether a wait leaves one MMA in flight, and ptxas's spill bytes (None where ptxas is
not found). Run in a process without ``TRITON_INTERPRET`` (test_prefix_wgmma.py does).

    python -m support.compile_sm90 '[[block_m, block_n, head_dim, stages, overlap, ratio, warp_specialize,
                                      q_registers, arrive, sinks], ...]'
"""

import json
import re
import subprocess
import sys
import tempfile
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from granikv.kernels import prefix_wgmma, prefix_wgmma_ws


def compile_ptx(block_m: int, block_n: int, head_dim: int, stages: int, overlap: bool, ratio: int = 3,
                warp_specialize: bool = False, q_registers: bool = False, arrive: bool = False,
                sinks: bool = False) -> str:
    """The launch ``prefix_wgmma_attention`` makes with these settings, compiled for sm90."""
    buf = torch.zeros(1024, 8, head_dim, dtype=torch.bfloat16)
    desc = mangle_type(prefix_wgmma._descriptor(buf, block_n))
    types = dict(Q="*bf16", K="*bf16", V="*bf16", k_desc=desc, v_desc=desc, PartO="*fp32", PartLse="*fp32",
                 Counts="*i32", PfxItems="*i32", GroupReqIdx="*i32", PartIndptr="*i32", qk_scale="fp32",
                 Out="*bf16", Counter="*i32", Sinks="*fp32", v_scale="fp32")
    if warp_specialize:
        kernel = prefix_wgmma_ws._prefix_wgmma_ws_kernel
        consts = dict(RATIO=ratio, HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages,
                      CONSUMER_REGS=prefix_wgmma_ws.WS_CONSUMER_REGS, PRODUCER_REGS=prefix_wgmma_ws.WS_PRODUCER_REGS,
                      num_warps=4)
        options = dict(num_warps=4, maxnreg=prefix_wgmma_ws.WS_MAXNREG)
    else:
        kernel = prefix_wgmma._prefix_wgmma_kernel
        consts = dict(RATIO=ratio, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
                      OVERLAP=overlap, Q_REGS=q_registers, ARRIVE=arrive, HAS_SINKS=sinks, num_warps=block_m // 16)
        options = dict(num_warps=block_m // 16)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def spill_bytes(ptx: str) -> Optional[int]:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(90)
        path = getattr(tool, "path", tool)
    except Exception:  # noqa: BLE001 - no ptxas: spills unknown
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    found = re.findall(r"(\d+) bytes spill stores", out.stdout + out.stderr)
    return sum(int(x) for x in found) if found else None


def features(ptx: str) -> dict:
    return {"tma_loads": "cp.async.bulk.tensor.2d" in ptx,
            # the S = Q K^T MMA with its A operand in registers: "{%r...}" where a shared-memory
            # descriptor would be one 64-bit register
            "register_a_shapes": sorted(set(re.findall(
                r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(?:bf16|f16)\.(?:bf16|f16)\s+\{[^}]*\},\s*\{", ptx))),
            "wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "waits_leaving_one": "wgmma.wait_group.sync.aligned 1;" in ptx,
            "register_splits": sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)),
                                      key=int),
            "atomics": sorted(set(re.findall(r"atom\.[\w.]*add[\w.]*", ptx))),
            "spills": spill_bytes(ptx)}


if __name__ == "__main__":
    print(json.dumps([features(compile_ptx(*cfg)) for cfg in json.loads(sys.argv[1])]))
