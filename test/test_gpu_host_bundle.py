"""scripts/gpu_host_bundle.py, the pure parts of scripts/gpu_host_bundle.sh (no network, no
download): what leaves the SGLang / sglang-kernel / FlashInfer wheels, the re-zipped wheel being
a valid, installable wheel, the wheel checks, and the bundle's size limit."""

import csv
import importlib.util
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
HELPER = SCRIPTS / "gpu_host_bundle.py"
spec = importlib.util.spec_from_file_location("gpu_host_bundle", HELPER)
gb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gb)

SGLANG_MEMBERS = [
    "sglang/__init__.py",
    "sglang/srt/entrypoints/engine.py",
    "sglang/srt/rust_extensions/__init__.py",
    "sglang/srt/rust_extensions/loader.py",
    "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so",
    "sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so",
    "sglang/srt/mem_cache/rust_tree_core/adapter.py",
    "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so",
    "sglang/multimodal_gen/runtime/server_args/server_args.py",
    "sglang/test/kits/kit.py",
    "sglang/kernels/jit/csrc/attention/kda_prefill.cu",
    "sglang/kernels/ops/communication/configs/world=16,H=7168.json",  # a comma: RECORD quotes it
    "sglang/srt/multimodal_utils.py",   # not multimodal_gen/: kept
    "sglang/testing_utils.py",          # not test/: kept
]


def _wheel(path, members, dist="sglang-0.5.23.dist-info", tag="cp312-cp312-manylinux_2_34_x86_64"):
    """A small wheel: MEMBERS with distinct contents, METADATA, WHEEL and a RECORD."""
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for i, name in enumerate(members):
            data = f"content {i} of {name}\n".encode() * 20
            z.writestr(name, data)
            rows.append(gb._record_row(name, data))
        for f, text in (("METADATA", "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n"),
                        ("WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n")):
            z.writestr(f"{dist}/{f}", text)
            rows.append(gb._record_row(f"{dist}/{f}", text.encode()))
        rows.append([f"{dist}/RECORD", "", ""])
        z.writestr(f"{dist}/RECORD", gb._record_text(rows))
    return path


def test_sglang_rule_removes_multimodal_gen_test_and_every_rust_library():
    assert gb.removed_files(SGLANG_MEMBERS, "sglang") == [
        "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so",
        "sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so",
        "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so",
        "sglang/multimodal_gen/runtime/server_args/server_args.py",
        "sglang/test/kits/kit.py",
    ]


def test_kernel_rule_keeps_only_sm90_common_ops_and_spatial_ops():
    names = ["sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so",
             "sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so",
             "sgl_kernel/flash_ops.abi3.so", "sgl_kernel/infllm_ops.abi3.so",
             "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/flash_attn.py",
             "triton_kernels/matmul_ogs.py"]
    assert gb.removed_files(names, "sglang-kernel") == [
        "sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/flash_ops.abi3.so",
        "sgl_kernel/infllm_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so"]


def test_flashinfer_rule_drops_headers_and_keeps_csrc():
    names = ["flashinfer/__init__.py", "flashinfer/data/csrc/norm.cu",
             "flashinfer/data/cutlass/include/cute/tensor.hpp", "flashinfer/data/cccl/x.h",
             "flashinfer/data/include/flashinfer/attention.cuh", "flashinfer/data/spdlog/s.h"]
    assert gb.removed_files(names, "flashinfer") == names[2:]


@pytest.mark.parametrize("stored", [False, True])
def test_slim_wheel_is_a_valid_wheel_without_the_removed_files(tmp_path, stored):
    src = _wheel(tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", SGLANG_MEMBERS)
    out = tmp_path / "out"
    out.mkdir()
    dst = out / src.name
    gone = gb.slim_wheel(str(src), str(dst), "sglang", stored=stored)
    assert len(gone) == 5
    assert gb.check_wheel(str(dst)) == []
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst) as b:
        kept = [n for n in a.namelist() if n not in gone and not n.endswith("RECORD")]
        assert sorted(n for n in b.namelist() if not n.endswith("RECORD")) == sorted(kept)
        for n in kept:
            assert b.read(n) == a.read(n)
        methods = {i.compress_type for i in b.infolist()}
        assert methods == ({zipfile.ZIP_STORED} if stored else {zipfile.ZIP_DEFLATED})
        record = list(csv.reader(io.StringIO(b.read("sglang-0.5.23.dist-info/RECORD").decode())))
    listed = {row[0]: row for row in record}
    assert set(listed) == set(kept) | {"sglang-0.5.23.dist-info/RECORD"}
    assert "sglang/kernels/ops/communication/configs/world=16,H=7168.json" in listed
    with zipfile.ZipFile(dst) as b:
        for n in kept:  # hashes and sizes match the members
            assert listed[n] == gb._record_row(n, b.read(n))


def test_pip_installs_the_slim_wheel_with_no_deps(tmp_path):
    # pip checks the members against RECORD; a py3 tag so that this Python accepts the wheel.
    src = _wheel(tmp_path / "sglang-0.5.23-py3-none-any.whl", SGLANG_MEMBERS, tag="py3-none-any")
    out = tmp_path / "out"
    out.mkdir()
    gb.slim_wheel(str(src), str(out / src.name), "sglang", stored=True)
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-compile", "--target", str(target), str(out / src.name)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (target / "sglang" / "srt" / "entrypoints" / "engine.py").exists()
    assert (target / "sglang" / "srt" / "rust_extensions" / "loader.py").exists()
    assert not (target / "sglang" / "test").exists()
    assert not (target / "sglang" / "multimodal_gen").exists()
    assert not list(target.rglob("*.so"))


def test_check_wheel_reports_broken_wheels(tmp_path):
    good = _wheel(tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", ["sglang/a.py"])
    assert gb.check_wheel(str(good)) == []
    no_dist = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(no_dist, "w") as z:
        z.writestr("x/__init__.py", "")
    assert "expected one .dist-info" in gb.check_wheel(str(no_dist))[0]
    not_zip = tmp_path / "y-1.0-py3-none-any.whl"
    not_zip.write_bytes(b"not a zip")
    assert "not a zip" in gb.check_wheel(str(not_zip))[0]
    unlisted = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    with zipfile.ZipFile(good) as a, zipfile.ZipFile(unlisted, "w") as b:
        for n in a.namelist():
            b.writestr(n, a.read(n))
        b.writestr("sglang/extra.py", "")
    assert "not in RECORD" in gb.check_wheel(str(unlisted))[0]
    p = subprocess.run([sys.executable, str(HELPER), "check-wheels", str(good), str(not_zip)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "1 problems" in p.stdout


def test_size_check_fails_above_the_limit(tmp_path):
    assert gb.BUNDLE_LIMIT == 56 * gb.MIB and gb.TRAVEL_LIMIT == 64 * gb.MIB
    assert gb.size_problem(gb.BUNDLE_LIMIT, gb.BUNDLE_LIMIT) is None
    assert "over its limit" in gb.size_problem(gb.BUNDLE_LIMIT + 1, gb.BUNDLE_LIMIT)
    # under its own limit, but not with the project beside it
    assert "over 64 MiB" in gb.size_problem(50 * gb.MIB, gb.BUNDLE_LIMIT, 15 * gb.MIB)
    d = tmp_path / "bundle"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "f").write_bytes(b"x" * 5000)
    size = gb.tree_size(str(d))
    du = subprocess.run(["du", "-sb", str(d)], capture_output=True, text=True)
    if du.returncode == 0:
        assert size == int(du.stdout.split()[0])
    cli = [sys.executable, str(HELPER), "size", str(d)]
    assert subprocess.run(cli + [str(size)], capture_output=True, timeout=60).returncode == 0
    p = subprocess.run(cli + [str(size - 1)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "over its limit" in p.stderr


def test_wheel_lookup_and_which_wheels_this_python_loads(tmp_path):
    files = ["pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl",
             "pydantic-2.14.4-py3-none-any.whl",
             "partial_json_parser-0.2.1.1.post7-py3-none-any.whl"]
    assert gb.wheel_for("pydantic-core==2.50.5", files) == files[0]
    assert gb.wheel_for("pydantic==2.14.4", files) == files[1]
    assert gb.wheel_for("partial-json-parser==0.2.1.1.post7", files) == files[2]
    assert gb.wheel_for("pydantic==2.14.5", files) is None
    compiled = tmp_path / "m-1.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(compiled, "w") as z:
        z.writestr("m/_m.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
    assert gb.wheel_runs_here(str(compiled), (3, 12))
    assert not gb.wheel_runs_here(str(compiled), (3, 11))
    abi3 = tmp_path / "k-1.0-cp310-abi3-manylinux2014_x86_64.whl"
    abi3.write_bytes(compiled.read_bytes())
    assert gb.wheel_runs_here(str(abi3), (3, 11)) and not gb.wheel_runs_here(str(abi3), (3, 9))
    # the slimmed SGLang wheel keeps its cp312 tag but has no compiled member left
    pure = _wheel(tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", ["sglang/a.py"])
    assert gb.wheel_runs_here(str(pure), (3, 11))


def test_import_diff_names_packages_only_the_new_release_loads(tmp_path):
    site = tmp_path / "site"
    old = {"torch": "/venv/torch/__init__.py", "sglang": "/old/sglang/__init__.py"}
    new = dict(old, transformers=str(site / "transformers" / "__init__.py"),
               anthropic="/venv/anthropic/__init__.py")
    assert gb.new_packages(old, new, str(site)) == ["anthropic"]
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("ok   x\nloaded-packages " + json.dumps(old) + "\n")
    b.write_text("loaded-packages " + json.dumps(new) + "\n")
    p = subprocess.run([sys.executable, str(HELPER), "import-diff", str(a), str(b), str(site)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "anthropic" in p.stdout


def test_stubs_resolve_any_name(tmp_path):
    gb.write_stubs(str(tmp_path), ["xgrammar", "xgrammar.structural_tag"])
    code = ("import xgrammar, xgrammar.structural_tag as s; "
            "assert not xgrammar.testing.anything(1); print(isinstance(s.Tag, type))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr


def test_bundle_is_git_ignored_and_setup_sets_the_version_check_skip():
    root = SCRIPTS.parent
    assert "/.gpu-host-0.5.23/" in (root / ".gitignore").read_text().split()
    setup = (SCRIPTS / "gpu_host_bundle_setup.sh").read_text()
    assert "export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1" in setup
    assert 'exec "$@"' in setup
    sh = (SCRIPTS / "gpu_host_bundle.sh").read_text()
    assert "sglang==0.5.23" in sh and "sglang-kernel==0.4.5" in sh
    assert "flashinfer-python==0.6.15.post1" in sh
