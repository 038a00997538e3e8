"""Pure parts of scripts/gpu_host_bundle.sh: which files leave the SGLang and sglang-kernel wheels,
re-zipping a wheel without them, checking wheels, and the bundle's size limit.

    python3 scripts/gpu_host_bundle.py slim[-stored] PROFILE SRC.whl DST_DIR
            # PROFILE: sglang | sglang-kernel | flashinfer | none; -stored: members uncompressed
    python3 scripts/gpu_host_bundle.py find DIR NAME==VERSION        # that wheel's path in DIR
    python3 scripts/gpu_host_bundle.py check-wheels WHEEL...
    python3 scripts/gpu_host_bundle.py size DIR LIMIT_BYTES|bundle [PROJECT_BYTES]
    python3 scripts/gpu_host_bundle.py stubs DIR        # import stubs (see STUBBED)
    python3 scripts/gpu_host_bundle.py unpack-for-check SITE WHEEL...   # wheels this Python can load
    PYTHONPATH=SITE:STUBS python3 scripts/gpu_host_bundle.py import-check [--fake-sm90]
    python3 scripts/gpu_host_bundle.py import-diff OLD.txt NEW.txt SITE   # packages NEW adds

Standard library only, but import-check (which needs torch and what it imports).
"""

import base64
import csv
import hashlib
import io
import importlib.util
import json
import os
import re
import sys
import textwrap
import zipfile

MIB = 1 << 20
# What travels to the GPU host: at most 64 MiB, the project's working tree included.
TRAVEL_LIMIT = 64 * MIB
# The bundle's own share: the project's tracked files are ~7 MiB.
BUNDLE_LIMIT = 56 * MIB


def _sglang_removed(name):
    """SGLang 0.5.23: the diffusion runtime, its test package and the Rust extensions (the Rust
    HTTP server is off by default, SGLANG_RUST_SERVER=False; the radix tree's Rust core has a
    Python fallback)."""
    if name.startswith(("sglang/multimodal_gen/", "sglang/test/")):
        return True
    return name.startswith("sglang/") and name.endswith(".so")


# sglang-kernel 0.4.5: the compiled libraries kept. Dropped: flash_ops (FA3, 1.1 GB), sm100/,
# infllm_ops and flashmla_ops (loaded lazily, only by InfLLM-v2 / DeepSeek MLA paths).
KERNEL_KEPT_LIBS = ("sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so")


def _kernel_removed(name):
    if name.startswith("sgl_kernel/sm100/"):
        return True
    return name.startswith("sgl_kernel/") and ".so" in os.path.basename(name) \
        and name not in KERNEL_KEPT_LIBS


# flashinfer-python: the CUTLASS / CCCL / include / spdlog headers (only a JIT build on the host
# would need them; every module this path loads is prebuilt in fi_aot/). data/csrc stays:
# FlashInfer renders its generated sources from it even when the module is prebuilt.
FLASHINFER_DROPPED_DIRS = ("flashinfer/data/cutlass/", "flashinfer/data/cccl/",
                           "flashinfer/data/include/", "flashinfer/data/spdlog/")


def _flashinfer_removed(name):
    return name.startswith(FLASHINFER_DROPPED_DIRS)


PROFILES = {"sglang": _sglang_removed, "sglang-kernel": _kernel_removed,
            "flashinfer": _flashinfer_removed}


def removed_files(names, profile):
    """The members of a wheel (names as listed in the zip) that PROFILE drops, in order."""
    rule = PROFILES[profile]
    return [n for n in names if not n.endswith("/") and rule(n)]


def _dist_info(names):
    dirs = sorted({n.split("/", 1)[0] for n in names if re.match(r"[^/]+\.dist-info/", n)})
    return dirs


def _record_row(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def _record_text(rows):
    """RECORD is CSV: a member name with a comma (SGLang has such config files) is quoted."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def slim_wheel(src, dst, profile=None, stored=False, compresslevel=9):
    """Write SRC without PROFILE's files (None: none removed) to DST, a valid wheel: the members
    kept byte for byte, RECORD rewritten to list exactly those. stored=True writes the members
    uncompressed (the bundle's wheels travel inside one xz archive, which compresses the Python
    sources of all of them together far better than each zip member alone). Returns the names
    removed."""
    method = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        dist = _dist_info(names)
        if len(dist) != 1:
            raise ValueError(f"{src}: expected one .dist-info, found {dist}")
        record = f"{dist[0]}/RECORD"
        gone = set(removed_files(names, profile)) if profile else set()
        tmp = dst + ".part"
        rows = []
        with zipfile.ZipFile(tmp, "w", method, compresslevel=None if stored else compresslevel) as zout:
            for info in zin.infolist():
                n = info.filename
                if n in gone or n == record:
                    continue
                data = zin.read(info)
                out = zipfile.ZipInfo(n, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = zipfile.ZIP_STORED if n.endswith("/") else method
                zout.writestr(out, data)
                if not n.endswith("/"):
                    rows.append(_record_row(n, data))
            rows.append([record, "", ""])
            zout.writestr(zipfile.ZipInfo(record, date_time=(2020, 1, 1, 0, 0, 0)),
                          _record_text(rows), compress_type=method)
    os.replace(tmp, dst)
    return sorted(gone)


def _norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(pin, files):
    """The file among FILES (wheel file names) that is PIN (`name==version`), or None."""
    name, version = pin.split("==")
    for f in sorted(files):
        parts = os.path.basename(f).split("-")
        if f.endswith(".whl") and len(parts) >= 5 and _norm(parts[0]) == _norm(name) \
                and parts[1] == version:
            return f
    return None


def check_wheel(path):
    """Problems with one wheel file ([] when it is a readable zip with one complete .dist-info
    whose RECORD lists every member)."""
    base = os.path.basename(path)
    if not base.endswith(".whl") or base.count("-") < 4:
        return [f"{base}: not a wheel file name"]
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            if bad:
                return [f"{base}: corrupt member {bad}"]
            names = z.namelist()
            dist = _dist_info(names)
            if len(dist) != 1:
                return [f"{base}: expected one .dist-info, found {dist}"]
            problems = [f"{base}: {dist[0]}/{f} missing" for f in ("METADATA", "WHEEL", "RECORD")
                        if f"{dist[0]}/{f}" not in names]
            if not problems:
                rows = csv.reader(io.StringIO(z.read(f"{dist[0]}/RECORD").decode()))
                listed = {row[0] for row in rows if row}
                unlisted = [n for n in names if not n.endswith("/") and n not in listed]
                if unlisted:
                    problems.append(f"{base}: {len(unlisted)} members not in RECORD ({unlisted[0]})")
            return problems
    except zipfile.BadZipFile as e:
        return [f"{base}: not a zip ({e})"]


def tree_size(path):
    """Apparent size of a folder as `du -sb` counts it: every file, link and folder entry."""
    total = os.lstat(path).st_size
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            total += os.lstat(os.path.join(root, n)).st_size
    return total


def size_problem(size, limit, extra=0):
    """None when SIZE (+ EXTRA, e.g. the project's tracked files) fits, else the message."""
    if size > limit:
        return f"bundle is {size} bytes ({size / MIB:.1f} MiB), over its limit {limit} ({limit / MIB:.1f} MiB)"
    if size + extra > TRAVEL_LIMIT:
        return (f"bundle {size / MIB:.1f} MiB + project {extra / MIB:.1f} MiB = "
                f"{(size + extra) / MIB:.1f} MiB, over {TRAVEL_LIMIT / MIB:.0f} MiB")
    return None


STUB_SRC = textwrap.dedent('''
    class _Any:
        def __init__(self, *a, **k): pass
        def __call__(self, *a, **k): return _Any()
        def __getattr__(self, n):
            if n.startswith("__") and n.endswith("__"): raise AttributeError(n)
            return _Any()
        def __mro_entries__(self, bases): return (object,)
        def __iter__(self): return iter(())
        def __bool__(self): return False
    def _schema(cls, source, handler):
        from pydantic_core import core_schema
        return core_schema.any_schema()
    class _Meta(type):
        def __getattr__(cls, n):
            if n.startswith("__") and n.endswith("__"): raise AttributeError(n)
            return _Any()
    _types = {}
    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"): raise AttributeError(name)
        if name[:1].isupper():
            if name not in _types:
                _types[name] = _Meta(name, (), {"__init__": lambda self, *a, **k: None,
                                                "__get_pydantic_core_schema__": classmethod(_schema)})
            return _types[name]
        return _Any()
''')

# Imported at module level by SGLang (0.5.17 and 0.5.23) but unused on this path (dense models,
# triton / flashinfer attention, grammar_backend="none"):
#   IPython (sglang.utils display helpers), xgrammar (function-call detectors; grammar_backend="none"),
#   gguf (gguf quant), jsonschema (tool-call validation),
#   soundfile (realtime audio endpoints),
#   cutlass (nvidia-cutlass-dsl, ~0.3 GB: 0.5.23's LlamaMLP imports its SM100 dual-GEMM module,
#   sglang.kernels.ops.gemm.cutedsl_dual_gemm, at construction; on SM90 ``can_use_dual_gemm``
#   is False before any cutlass name is used, so the stock MLP runs, as with the real package).
CUTLASS_STUBBED = ["cutlass", "cutlass.cute", "cutlass.cute.experimental", "cutlass.cute.nvgpu",
                   "cutlass.cute.nvgpu.tcgen05", "cutlass.cute.runtime", "cutlass.utils",
                   "cutlass.utils.blackwell_helpers"]
STUBBED = ["IPython", "IPython.display", "xgrammar", "xgrammar.structural_tag", "gguf", "jsonschema",
           "soundfile", *CUTLASS_STUBBED]


def write_stubs(root, names=STUBBED):
    """Stand-ins for NAMES under ROOT (put ROOT on PYTHONPATH after the real packages): any
    attribute resolves; capitalized names are classes pydantic accepts. Using a stubbed feature
    (grammar-constrained decoding, GGUF, audio endpoints, tool-call schema validation) fails."""
    for name in names:
        d = root
        for part in name.split("."):
            d = os.path.join(d, part)
            os.makedirs(d, exist_ok=True)
            f = os.path.join(d, "__init__.py")
            if not os.path.exists(f):
                with open(f, "w") as fh:
                    fh.write(STUB_SRC)


def wheel_runs_here(path, version=sys.version_info[:2]):
    """Whether this Python can import PATH's contents: a wheel without compiled members runs on
    any Python 3 (the slimmed SGLang wheel keeps its cp312 tag but has no .so left); else its tag
    must be py3, abi3 of an older CPython, or this CPython."""
    with zipfile.ZipFile(path) as z:
        if not any(n.endswith((".so", ".pyd")) or ".so." in n for n in z.namelist()):
            return True
    parts = os.path.basename(path)[:-4].split("-")
    pys, abis = parts[-3].split("."), parts[-2].split(".")
    here = f"cp{version[0]}{version[1]}"
    if here in pys or "py3" in pys and "none" in abis:
        return True
    for py in pys:
        m = re.fullmatch(r"cp3(\d+)", py)
        if m and "abi3" in abis and int(m.group(1)) <= version[1]:
            return True
    return False


# What GraniKV's triton and flashinfer paths import on the host: SGLang's engine, server,
# scheduler, model runner, the dense models, both attention backends, layernorm and the sampler;
# then GraniKV's own modules and the flashinfer names it calls.
IMPORTS = [
    "sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama", "sglang.srt.models.qwen2", "sglang.srt.models.qwen3",
    "sglang.srt.models.qwen3_moe", "sglang.srt.layers.attention.flashinfer_backend",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.layernorm",
    "sglang.srt.layers.sampler", "sglang.srt.mem_cache.radix_cache",
    "granikv.plugin", "granikv.attention.backend", "granikv.kernels.cascade",
    "granikv.kernels.fused_cascade", "granikv.kernels.suffix_attention",
]
# imported lazily, at model construction, by the models above (0.5.23's LlamaMLP: DualGemm);
# a module of a release that lacks one is skipped
LAZY_IMPORTS = ["sglang.srt.layers.dual_gemm", "sglang.kernels.ops.gemm.cutedsl_dual_gemm"]
FLASHINFER_NAMES = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                    "BatchDecodeWithPagedKVCacheWrapper", "MultiLevelCascadeAttentionWrapper",
                    "merge_state"]


def _fake_sm90():
    """Make this CPU machine look like an H200 to the import-time checks (torch.cuda.* and
    sgl_kernel's compiled-ops loader, whose library needs libcuda.so.1): SGLang's CUDA branches
    then import what they import on the host, sgl_kernel's Python API included."""
    import types
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    props = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200", multi_processor_count=132,
                                  total_memory=140 << 30, gcnArchName="", warp_size=32,
                                  L2_cache_size=60 << 20, regs_per_multiprocessor=65536,
                                  max_threads_per_multi_processor=2048,
                                  shared_memory_per_block_optin=232448)
    torch.cuda.get_device_properties = lambda *a, **k: props
    # sgl_kernel falls back to a plain `import common_ops` when its .so cannot load.
    ops = types.ModuleType("common_ops")
    ops.__file__ = "<fake common_ops: the compiled library is not loaded on CPU>"
    sys.modules.setdefault("common_ops", ops)


def _has_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def import_check(fake_sm90):
    import importlib
    import traceback
    os.environ.setdefault("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")
    if fake_sm90:
        _fake_sm90()
    failed = 0
    lazy = [m for m in LAZY_IMPORTS if _has_module(m)]
    for mod in IMPORTS + lazy:
        try:
            importlib.import_module(mod)
            print(f"ok   {mod}")
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failed += 1
            frames = traceback.extract_tb(e.__traceback__)
            tb = ([f for f in frames if "/torch/" not in f.filename] or frames)[-1]
            print(f"FAIL {mod}: {type(e).__name__}: {e} ({tb.filename}:{tb.lineno})")
    try:
        import flashinfer
        missing = [n for n in FLASHINFER_NAMES if not hasattr(flashinfer, n)]
        print(f"{'ok  ' if not missing else 'FAIL'} flashinfer {flashinfer.__version__} names"
              + (f": missing {missing}" if missing else ""))
        failed += bool(missing)
    except Exception as e:  # noqa: BLE001
        failed += 1
        print(f"FAIL flashinfer: {e}")
    import sglang
    print(f"sglang {sglang.__version__} from {os.path.dirname(sglang.__file__)}")
    kernel = sys.modules.get("sgl_kernel")
    if fake_sm90:  # the CUDA branches were taken: SGLang imported sgl_kernel's Python API
        print(f"{'ok  ' if kernel else 'FAIL'} sgl_kernel "
              + (f"{getattr(kernel, '__version__', '?')} imported by SGLang" if kernel else "not imported"))
        failed += kernel is None
    third = sorted({m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names))
    origins = {}
    for top in third:
        f = getattr(sys.modules.get(top), "__file__", None) or ""
        origins[top] = f
    print("loaded-packages " + json.dumps(origins, sort_keys=True))
    return 1 if failed else 0


def _loaded(path):
    for line in open(path):
        if line.startswith("loaded-packages "):
            return json.loads(line.split(" ", 1)[1])
    raise ValueError(f"{path}: no loaded-packages line")


def new_packages(old, new, site):
    """Top-level packages NEW loaded that OLD did not and that do not come from SITE (the
    bundle's own wheels): what the host, which ran OLD, may lack. Both are import-check maps."""
    site = os.path.abspath(site) + os.sep
    return sorted(k for k, f in new.items() if k not in old and not os.path.abspath(f or "/").startswith(site))


def main(argv):
    if len(argv) >= 4 and argv[0] in ("slim", "slim-stored"):
        profile, src, dst_dir = argv[1:4]
        dst = os.path.join(dst_dir, os.path.basename(src))
        gone = slim_wheel(src, dst, None if profile == "none" else profile,
                          stored=argv[0] == "slim-stored")
        print(f"{os.path.basename(src)}: {len(gone)} files removed, {os.path.getsize(src) / MIB:.1f}"
              f" -> {os.path.getsize(dst) / MIB:.1f} MiB"
              + (" (members stored uncompressed)" if argv[0] == "slim-stored" else ""))
        return 0
    if len(argv) >= 2 and argv[0] == "find":
        # find DIR PIN: the wheel in DIR that is PIN (exit 1 when none)
        found = wheel_for(argv[2], os.listdir(argv[1])) if os.path.isdir(argv[1]) else None
        if found:
            print(os.path.join(argv[1], found))
        return 0 if found else 1
    if len(argv) >= 2 and argv[0] == "check-wheels":
        problems = [p for w in argv[1:] for p in check_wheel(w)]
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(argv) - 1} wheels checked, {len(problems)} problems")
        return 1 if problems else 0
    if len(argv) in (3, 4) and argv[0] == "size":
        size = tree_size(argv[1])
        extra = int(argv[3]) if len(argv) == 4 else 0
        msg = size_problem(size, BUNDLE_LIMIT if argv[2] == "bundle" else int(argv[2]), extra)
        print(f"{argv[1]}: {size} bytes ({size / MIB:.2f} MiB); with the project "
              f"{(size + extra) / MIB:.2f} MiB of {TRAVEL_LIMIT / MIB:.0f}")
        if msg:
            print(msg, file=sys.stderr)
            return 1
        return 0
    if len(argv) >= 3 and argv[0] == "unpack-for-check":
        site = argv[1]
        os.makedirs(site, exist_ok=True)
        for w in argv[2:]:
            if wheel_runs_here(w):
                with zipfile.ZipFile(w) as z:
                    z.extractall(site)
            else:
                print(f"not loadable by this Python, its own copy is used: {os.path.basename(w)}")
        return 0
    if len(argv) == 4 and argv[0] == "import-diff":
        extra = new_packages(_loaded(argv[1]), _loaded(argv[2]), argv[3])
        print(f"packages loaded by the new import set and not by the old one, outside the bundle: "
              f"{', '.join(extra) if extra else 'none'}")
        return 1 if extra else 0
    if len(argv) == 2 and argv[0] == "stubs":
        write_stubs(argv[1])
        print("stubs written:", ", ".join(STUBBED))
        return 0
    if argv and argv[0] == "import-check":
        return import_check("--fake-sm90" in argv)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
