"""The plugin as SGLang sees it: entry point discovery, flag parsing, disabled == stock SGLang."""

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from granikv import plugin, server_settings
from granikv.config import GraniKVConfig

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# Runs in a fresh interpreter, as `python -m sglang.launch_server` would: load_plugins() first,
# then prepare_server_args(argv). Prints one JSON line per argv.
PROBE = textwrap.dedent(
    """
    import json, pickle, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    for argv in json.loads(sys.argv[1]):
        try:
            sa = pickle.loads(pickle.dumps(prepare_server_args(argv)))  # as sent to schedulers
            cfg = sa._granikv
            out = {"ok": True, "cfg": cfg.to_mapping(), "radix": sa.radix_cache_backend,
                   "page_size": sa.page_size}
        except SystemExit as e:
            out = {"ok": False, "exit": e.code}
        except Exception as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("PROBE " + json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


def _probe(argvs):
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=300)
    rows = [json.loads(l[6:]) for l in proc.stdout.splitlines() if l.startswith("PROBE ")]
    assert len(rows) == len(argvs), proc.stdout[-2000:] + proc.stderr[-4000:]
    return rows, proc.stderr


def test_entry_point_is_registered():
    eps = entry_points(group="sglang.srt.plugins")
    assert any(ep.name == "granikv" and ep.value == "granikv.plugin:register" for ep in eps)


def test_flags_parse_in_a_fresh_process(model_dir):
    base = ["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init"]
    rows, stderr = _probe([
        base + ["--enable-granikv", "--granikv-hot-min-tokens", "4096",
                "--granikv-attention-path", "cascade", "--page-size", "16"],
        base,
        base + ["--granikv-attention-path", "magic", "--granikv-hot-fraction", "2.0"],
    ])
    on, off, ignored = rows
    assert on["ok"] and on["cfg"]["enable_granikv"] is True
    assert on["cfg"]["granikv_hot_min_tokens"] == 4096
    assert on["cfg"]["granikv_attention_path"] == "cascade"
    assert on["radix"] == "granikv" and on["page_size"] == 1
    assert "--page-size=16 overridden to 1" in stderr
    # Installed but not enabled: SGLang's own settings are untouched.
    assert off["ok"] and off["cfg"]["enable_granikv"] is False
    assert off["radix"] is None
    # Without --enable-granikv, even invalid GraniKV values are ignored, with one warning.
    assert ignored["ok"] and ignored["cfg"] == GraniKVConfig().to_mapping()
    assert ignored["radix"] is None
    warnings = [l for l in stderr.splitlines() if "ignored (GraniKV is off" in l]
    assert len(warnings) == 1, stderr[-3000:]
    assert "--granikv-attention-path='magic', --granikv-hot-fraction=2.0" in warnings[0]


LAUNCH = textwrap.dedent(
    """
    import sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    prepare_server_args(sys.argv[1:])
    print("PARSED")
    """
)


@pytest.mark.parametrize("argv, line", [
    (["--granikv-hot-fraction", "2.0"], "error: --granikv-hot-fraction=2.0 is outside [0.0, 1.0]"),
    (["--granikv-attention-path", "magic"],
     "error: --granikv-attention-path='magic' is not one of auto, cascade, fused, bgemm, paged"),
    (["--disable-radix-cache"],
     "error: --enable-granikv needs the radix cache; drop --disable-radix-cache"),
])
def test_invalid_value_with_granikv_on_ends_in_one_line(model_dir, argv, line):
    """As the launcher runs it: exit status 2 and one ``error: ...`` line, no traceback."""
    argv = ["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init",
            "--enable-granikv"] + argv
    proc = subprocess.run([sys.executable, "-c", LAUNCH] + argv, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "PARSED" not in proc.stdout
    assert proc.stderr.splitlines()[-1] == line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


class _FakeConfigurator:
    def __init__(self, enable):
        self.server_args = type("SA", (), {"_granikv": GraniKVConfig(enable=enable)})()
        self.is_draft_worker = False


def test_disabled_hooks_keep_stock_objects():
    """With the plugin installed but not enabled, every hook hands back SGLang's own object."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    stock = object.__new__(TokenToKVPoolAllocator)
    assert plugin._after_build_allocator(stock, _FakeConfigurator(False), sizes=None,
                                         token_to_kv_pool=None, is_dsv4_model=False,
                                         req_to_token_pool=None,
                                         token_to_kv_pool_allocator=None) is None
    inner = object()
    runner = type("MR", (), {"server_args": _FakeConfigurator(False).server_args})()
    got = plugin._around_build_attn_backend(lambda **kw: inner, model_runner=runner,
                                            backend_str="triton", init_new_workspace=False)
    assert got is inner
    sched = type("S", (), {"server_args": runner.server_args})()
    assert plugin._before_run_batch(sched, batch=None) is None


def test_engine_kwargs_become_config():
    """sglang.Engine(enable_granikv=True, granikv_*=...) -> ServerArgs(**kwargs): the hook takes
    the GraniKV keywords out, validates them and attaches the config."""
    seen = {}

    class FakeServerArgs:
        pass

    def orig(self, **kw):
        seen.update(kw)

    sa = FakeServerArgs()
    plugin._around_server_args_init(orig, sa, model_path="m", enable_granikv=True,
                                    granikv_hot_min_tokens=2048, page_size=4)
    assert seen["radix_cache_backend"] == "granikv" and seen["page_size"] == 1
    assert "enable_granikv" not in seen and "granikv_hot_min_tokens" not in seen
    assert sa._granikv.enable and sa._granikv.hot_min_tokens == 2048
    off = FakeServerArgs()
    seen.clear()
    plugin._around_server_args_init(orig, off, model_path="m", page_size=4)
    assert seen == {"model_path": "m", "page_size": 4} and not off._granikv.enable
    ignored = FakeServerArgs()  # GraniKV keywords without enable_granikv: dropped, not checked
    seen.clear()
    plugin._around_server_args_init(orig, ignored, model_path="m", granikv_hot_min_tokens=0)
    assert seen == {"model_path": "m"} and ignored._granikv == GraniKVConfig()
    with pytest.raises(ValueError, match="--granikv-hot-min-tokens=0"):
        plugin._around_server_args_init(orig, FakeServerArgs(), model_path="m",
                                        enable_granikv=True, granikv_hot_min_tokens=0)


def test_internal_state_carries_granikv_counters():
    """Engine.get_server_info()['internal_states'][i]['granikv'] is filled by the hook."""
    from granikv.mem_cache.metrics import GraniKVMetrics

    metrics = GraniKVMetrics(promotions=3)
    cache = type("C", (), {"metrics": metrics, "refresh_gauges": lambda self: None})()
    on = type("S", (), {"server_args": _FakeConfigurator(True).server_args, "tree_cache": cache,
                        "tp_worker": None})()
    result = type("Out", (), {"internal_state": {"last_gen_throughput": 1.0}})()
    plugin._after_get_internal_state(result, on, None)
    assert result.internal_state["granikv"]["promotions"] == 3
    off = type("S", (), {"server_args": _FakeConfigurator(False).server_args})()
    result = type("Out", (), {"internal_state": {}})()
    plugin._after_get_internal_state(result, off, None)
    assert "granikv" not in result.internal_state


def _server_kwargs(**given):
    kw = dict(given)
    server_settings.apply_to_server_kwargs(GraniKVConfig(enable=True), kw.get, kw.__setitem__)
    return kw


def test_no_attention_backend_on_cuda_gets_a_verified_one(caplog, monkeypatch):
    """SGLang's default would be fa3 on Hopper (slower than flashinfer at GraniKV's page size 1) or
    trtllm_mha on Blackwell (never run behind GraniKV): with --enable-granikv and no backend given,
    flashinfer is chosen where installed, else triton, with one line saying why."""
    caplog.set_level("INFO", logger="granikv")
    assert _server_kwargs(device="cuda")["attention_backend"] == "flashinfer"
    line = [r.getMessage() for r in caplog.records if "no --attention-backend" in r.getMessage()]
    assert len(line) == 1 and "fa3 on Hopper" in line[0] and "flashinfer, triton, fa3" in line[0]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a))
    assert _server_kwargs(device="cuda")["attention_backend"] == "triton"


def test_a_given_backend_is_kept_and_an_unverified_one_named(caplog):
    caplog.set_level("INFO", logger="granikv")
    assert _server_kwargs(device="cuda", attention_backend="triton")["attention_backend"] == "triton"
    assert _server_kwargs(device="cuda", decode_attention_backend="flashinfer").get("attention_backend") is None
    assert not [r for r in caplog.records if "not been verified" in r.getMessage()]
    assert _server_kwargs(device="cuda", attention_backend="fa3")["attention_backend"] == "fa3"
    assert not [r for r in caplog.records if "not been verified" in r.getMessage()]  # fa3: verified on an H200
    assert _server_kwargs(device="cuda", attention_backend="trtllm_mha")["attention_backend"] == "trtllm_mha"
    warn = [r.getMessage() for r in caplog.records if "not been verified" in r.getMessage()]
    assert len(warn) == 1 and "--attention-backend=trtllm_mha" in warn[0]
    assert "attention_backend" not in _server_kwargs(device="cpu")  # other platforms: SGLang's choice
