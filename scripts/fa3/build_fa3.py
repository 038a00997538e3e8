#!/usr/bin/env python3
"""Minimal FA3 (sm_90a, bf16, hdim 64/128, fwd only) build producing sgl_kernel/flash_ops.abi3.so.

Registers torch.ops.sgl_kernel.fwd and torch.ops.sgl_kernel.get_scheduler_metadata with the
argument lists that sglang-kernel 0.4.5's sgl_kernel/flash_attn.py uses.

Layout expected (--src, default: dir of this script / src):
  src/hopper/               sgl-project/sgl-flash-attn hopper/ (tested snapshot: refs/pull/24/merge 2f8199e)
  src/cutlass/include, src/cutlass/tools/util/include   NVIDIA/cutlass 7127592 (submodule pin)
  flash_extension_min.cc (beside this script)

Kernel .cu files need NO torch (can be built anywhere with nvcc >= 12.4); only flash_api.cpp and
flash_extension_min.cc need torch headers -> build those against the torch that will load the .so (2.11).

Usage:
  python build_fa3.py --list
  python build_fa3.py [--max-jobs N] [--out DIR] [--only-kernels] [--nvcc PATH] [--no-nice]
"""
import argparse, os, shlex, subprocess, sys, time, sysconfig
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))

HDIMS = [64, 128]
DEFINES = [
    # as in sgl-kernel CMakeLists.txt (FLASH_OPS_COMPILE_DEFS)
    "FLASHATTENTION_DISABLE_BACKWARD", "FLASHATTENTION_DISABLE_DROPOUT", "FLASHATTENTION_DISABLE_UNEVEN_K",
    "FLASHATTENTION_VARLEN_ONLY", "FLASHATTENTION_DISABLE_SM8x",
    # extra trimming for this build
    "FLASHATTENTION_DISABLE_FP8", "FLASHATTENTION_DISABLE_FP16",
    "FLASHATTENTION_DISABLE_HDIM96", "FLASHATTENTION_DISABLE_HDIM192", "FLASHATTENTION_DISABLE_HDIM256",
    "FLASHATTENTION_DISABLE_HDIMDIFF64", "FLASHATTENTION_DISABLE_HDIMDIFF192",
    "FLASHATTENTION_DISABLE_SOFTCAP",   # layer.logit_cap must be 0 (no Gemma-2/Grok style softcap)
    "FLASHATTENTION_DISABLE_LOCAL",     # no sliding window / attention_chunk (no SWA models)
    "FLASHATTENTION_DISABLE_APPENDKV",  # sglang never passes k/v new
    "FLASHATTENTION_DISABLE_PACKGQA",   # split/paged-nonTMA paths still use PackGQA internally
    "FLASHATTENTION_DISABLE_CLUSTER",
]
CUDA_FLAGS = [
    "-DNDEBUG", "-O3", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
    "-DCUTE_USE_PACKED_TUPLE=1", "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-DCUTLASS_VERSIONS_GENERATED",
    "-DCUTLASS_TEST_LEVEL=0", "-DCUTLASS_TEST_ENABLE_CACHED_RESULTS=1", "-DCUTLASS_DEBUG_TRACE_LEVEL=0",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "-Xcompiler=-fno-strict-aliasing", "--threads", "1",
]


def kernel_files():
    files = []
    for h in HDIMS:
        for paged in ("", "_paged"):
            for split in ("", "_split"):
                files.append(f"instantiations/flash_fwd_hdim{h}_bf16{paged}{split}_sm90.cu")
    files += ["flash_fwd_combine.cu", "flash_prepare_scheduler.cu"]
    return files


def host_files():
    return ["flash_api.cpp", os.path.join(HERE, "flash_extension_min.cc")]


def torch_flags():
    import torch
    from torch.utils import cpp_extension as ce
    inc = ce.include_paths(device_type="cuda") if "device_type" in ce.include_paths.__code__.co_varnames else ce.include_paths(cuda=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [f"-I{p}" for p in inc] + [f"-I{sysconfig.get_paths()['include']}",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=flash_ops", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return flags, libdir, torch.__version__, torch.version.cuda


def run(cmd, nice, log):
    if nice:
        cmd = ["nice", "-n", "19"] + cmd
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dt = time.time() - t
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{p.stdout}\n[rc={p.returncode} {dt:.0f}s]\n")
    return p.returncode, dt, p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=os.path.join(HERE, "src"))
    ap.add_argument("--out", default=os.path.join(HERE, "build"))
    ap.add_argument("--max-jobs", type=int, default=int(os.environ.get("MAX_JOBS", "1")))
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only-kernels", action="store_true", help="compile the torch-free .cu objects only")
    ap.add_argument("--no-nice", action="store_true")
    a = ap.parse_args()
    hopper = os.path.join(a.src, "hopper")
    if a.list:
        for f in kernel_files():
            print(os.path.join(hopper, f))
        for f in host_files():
            print(f if os.path.isabs(f) else os.path.join(hopper, f))
        print("defines: " + " ".join("-D" + d for d in DEFINES))
        return
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "build.log")
    inc = [f"-I{hopper}", f"-I{a.src}/cutlass/include", f"-I{a.src}/cutlass/tools/util/include"]
    defs = ["-D" + d for d in DEFINES]
    jobs, objs = [], []
    for f in kernel_files():
        o = os.path.join(a.out, os.path.basename(f) + ".o")
        objs.append(o)
        if not os.path.exists(o):
            jobs.append([a.nvcc, "-c", os.path.join(hopper, f), "-o", o] + inc + defs + CUDA_FLAGS)
    tflags, libdir = [], None
    if not a.only_kernels:
        tflags, libdir, tv, tc = torch_flags()
        print(f"torch {tv} (CUDA {tc}) headers from {libdir}")
        for f in host_files():
            src = f if os.path.isabs(f) else os.path.join(hopper, f)
            o = os.path.join(a.out, os.path.basename(src) + ".o")
            objs.append(o)
            if not os.path.exists(o):
                # host files compiled by nvcc too (flash_api.cpp includes cuda headers); -x cu not needed
                jobs.append([a.nvcc, "-c", src, "-o", o, "-x", "c++", "-Xcompiler", "-fPIC", "-std=c++17", "-O3"]
                            + inc + defs + tflags + shlex.split(os.environ.get("FA3_HOST_FLAGS", "")))
    print(f"{len(jobs)} compile jobs, MAX_JOBS={a.max_jobs}")
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, a.max_jobs)) as ex:
        for cmd, (rc, dt, out) in zip(jobs, ex.map(lambda c: run(c, not a.no_nice, log), jobs)):
            print(f"[{'ok' if rc == 0 else 'FAIL'} {dt:5.0f}s] {os.path.basename(cmd[2])}", flush=True)
            if rc:
                print(out[-3000:]); sys.exit(1)
    if a.only_kernels:
        print(f"kernels done in {time.time()-t0:.0f}s"); return
    so = os.path.join(a.out, "flash_ops.abi3.so")
    link = ["g++", "-shared", "-o", so] + objs + [f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lc10", "-ltorch",
            "-ltorch_cpu", "-ltorch_cuda", "-lc10_cuda", f"-L{os.path.dirname(os.path.dirname(shlex.split(a.nvcc)[0]) or '/usr/local/cuda')}/lib64",
            "-lcudart", "-lcuda"]
    rc, dt, out = run(link, False, log)
    if rc:
        print(out[-3000:]); sys.exit(1)
    print(f"built {so} in {time.time()-t0:.0f}s; copy it to site-packages/sgl_kernel/flash_ops.abi3.so")


if __name__ == "__main__":
    main()
