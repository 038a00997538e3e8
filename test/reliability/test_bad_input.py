"""Bad input: invalid --granikv-* values and unsupported combinations fail at startup with a
clear message, or fall back to plain SGLang with a logged reason; never a crash mid-serving.

The flags go through SGLang's real ``prepare_server_args`` in ONE fresh interpreter (the
plugin is loaded the way ``python -m sglang.launch_server`` loads it; the import is slow).
"""

import json
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.eligibility import unsupported_reason
from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.radix_cache import GraniKVRadixCache

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}

# One JSON line per argv: ok, or the exception text, or argparse's exit code + its stderr.
PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                sa = prepare_server_args(argv)
            out = {"ok": True, "enable": sa._granikv.enable}
        except SystemExit as e:
            out = {"ok": False, "error": f"exit {e.code}: {err.getvalue()[-400:]}"}
        except Exception as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("PROBE " + json.dumps(out), flush=True)
    """
)

# (argv after the model, what the error must say: flag, value, range / reason)
CASES = [
    (["--granikv-hot-min-tokens", "15"],
     ["--granikv-hot-min-tokens=15", "[16, 4194304]"]),
    (["--granikv-hot-min-tokens", "4194305"],
     ["--granikv-hot-min-tokens=4194305", "[16, 4194304]"]),
    (["--granikv-hot-min-sharers", "0"], ["--granikv-hot-min-sharers=0", "[1, 4096]"]),
    (["--granikv-hot-min-sharers", "4097"], ["--granikv-hot-min-sharers=4097", "[1, 4096]"]),
    (["--granikv-hot-fraction", "-0.1"], ["--granikv-hot-fraction=-0.1", "[0.0, 1.0]"]),
    (["--granikv-hot-fraction", "1.5"], ["--granikv-hot-fraction=1.5", "[0.0, 1.0]"]),
    (["--granikv-min-group-size", "0"], ["--granikv-min-group-size=0", "[1, 4096]"]),
    (["--granikv-debug-compare-every", "-1"], ["--granikv-debug-compare-every=-1", "[0, "]),
    (["--granikv-log-interval", "-5"], ["--granikv-log-interval=-5", "[0, "]),
    # an option set, checked by the config like the ranges (one "error:" line, exit 2)
    (["--granikv-attention-path", "magic"], ["exit 2", "--granikv-attention-path", "'magic'",
                                             "auto", "paged"]),
    # argparse rejects these before GraniKV sees them (exit 2, message on stderr)
    (["--granikv-hot-min-tokens", "many"], ["exit 2", "--granikv-hot-min-tokens", "'many'"]),
    (["--granikv-hot-fraction", "half"], ["exit 2", "--granikv-hot-fraction", "'half'"]),
    # unsupported combinations
    (["--disable-radix-cache"], ["--enable-granikv needs the radix cache",
                                 "--disable-radix-cache"]),
    (["--radix-cache-backend", "other"], ["--enable-granikv needs --radix-cache-backend=granikv",
                                          "'other'"]),
]


def test_invalid_flags_fail_at_startup_naming_flag_value_and_range(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    base = ["--model-path", str(tmp_path), "--device", "cpu", "--skip-tokenizer-init",
            "--enable-granikv"]
    argvs = [base] + [base + extra for extra, _ in CASES]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=300)
    rows = [json.loads(l[6:]) for l in proc.stdout.splitlines() if l.startswith("PROBE ")]
    assert len(rows) == len(argvs), proc.stdout[-2000:] + proc.stderr[-4000:]
    assert rows[0] == {"ok": True, "enable": True}  # the control: valid flags start
    for (extra, needles), row in zip(CASES, rows[1:]):
        print(extra, "->", row["error"][:160].replace("\n", " "))
        assert not row["ok"], f"{extra} was accepted"
        for needle in needles:
            assert needle in row["error"], f"{extra}: {needle!r} not in {row['error']!r}"


# ---- attention: unsupported models fall back to the stock backend, with a logged reason ----


def _runner(**over):
    hf = SimpleNamespace(**over.pop("hf", {}))
    mc = SimpleNamespace(num_attention_heads=8, head_dim=over.pop("head_dim", 128),
                         num_hidden_layers=2, get_num_kv_heads=lambda tp: 2, hf_config=hf)
    sa = SimpleNamespace(speculative_algorithm=over.pop("spec", None))
    runner = SimpleNamespace(model_config=mc, server_args=sa, device="cpu",
                             kv_cache_dtype=torch.bfloat16, use_mla_backend=False,
                             sliding_window_size=None)
    for k, v in over.items():
        setattr(runner, k, v)
    return runner


def test_a_window_in_one_pool_is_left_to_the_layer_scan():
    """Without SGLang's hybrid SWA pool a model-level window does not turn GraniKV off: the
    layer scan finds the windowed layers (per-layer decode paths, decode/layer_paths.py)."""
    assert unsupported_reason(_runner(sliding_window_size=128, is_hybrid_swa=False), GraniKVConfig(enable=True)) is None


@pytest.mark.parametrize("runner_kwargs, reason", [
    ({"use_mla_backend": True}, "MLA attention"),
    ({"sliding_window_size": 128, "is_hybrid_swa": True},
     "sliding-window attention (window 128) in SGLang's hybrid SWA KV pool; start with --disable-hybrid-swa-memory"),
    ({"kv_cache_dtype": torch.float4_e2m1fn_x2}, "KV cache dtype torch.float4_e2m1fn_x2"),
    ({"head_dim": 96}, "head_dim=96"),
    ({"spec": "EAGLE"}, "speculative decoding (EAGLE)"),
    ({"hf": {"final_logit_softcapping": 30.0}}, "logit soft-capping"),
    ({"hf": {"attn_logit_softcapping": 50.0}}, "logit soft-capping"),
])
def test_unsupported_attention_falls_back_to_stock_backend(runner_kwargs, reason, caplog):
    runner, cfg = _runner(**runner_kwargs), GraniKVConfig(enable=True)
    assert reason in unsupported_reason(runner, cfg)
    inner = object()
    with caplog.at_level(logging.WARNING, logger="granikv"):
        got = GraniKVAttnBackend.wrap(inner, model_runner=runner, cfg=cfg, backend_name="triton")
    assert got is inner  # decode is served by SGLang's own backend
    assert reason in caplog.text and "stock triton backend" in caplog.text


def test_supported_attention_has_no_reason():
    assert unsupported_reason(_runner(), GraniKVConfig(enable=True)) is None


# ---- the radix cache refuses pools it cannot manage, at construction ----------------------


def _params(allocator, **over):
    req_pool = ReqToTokenPool(4, 64, "cpu", False)
    return CacheInitParams(**{"disable": False, "req_to_token_pool": req_pool,
                              "token_to_kv_pool_allocator": allocator, "page_size": 1, **over})


@pytest.fixture
def kv_pool():
    return MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=4,
                            layer_num=1, device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("over, needle", [
    ({"page_size": 16}, "page_size=16"),
    ({"is_eagle": True}, "is_eagle=True"),
    ({"disable": True}, "disable=True"),
])
def test_cache_rejects_unsupported_settings(kv_pool, over, needle):
    allocator = GraniKVAllocator(64, torch.bfloat16, "cpu", kv_pool, False, hot_fraction=0.25)
    with pytest.raises(ValueError, match="GraniKVRadixCache needs page_size=1") as e:
        GraniKVRadixCache.create(_params(allocator, **over), GraniKVConfig(enable=True), kv_pool)
    assert needle in str(e.value)


def test_cache_rejects_a_stock_allocator(kv_pool):
    stock = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", kv_pool, False)
    with pytest.raises(ValueError, match="needs a GraniKVAllocator, got TokenToKVPoolAllocator"):
        GraniKVRadixCache.create(_params(stock), GraniKVConfig(enable=True), kv_pool)


def test_allocator_rejects_a_paged_allocator(kv_pool):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    paged = PagedTokenToKVPoolAllocator(64, 16, torch.bfloat16, "cpu", kv_pool, False)
    with pytest.raises(ValueError, match=r"PagedTokenToKVPoolAllocator \(page_size=16\)"):
        GraniKVAllocator.from_stock(paged, hot_fraction=0.25)


def test_plugin_rejects_pools_it_cannot_manage(kv_pool):
    """Hybrid / SWA / MLA / paged pools: the allocator hook stops startup with a clear error."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    from granikv import plugin

    paged = PagedTokenToKVPoolAllocator(64, 16, torch.bfloat16, "cpu", kv_pool, False)
    conf = SimpleNamespace(server_args=SimpleNamespace(_granikv=GraniKVConfig(enable=True)),
                           is_draft_worker=False)
    with pytest.raises(ValueError, match=r"got PagedTokenToKVPoolAllocator \(page_size=16\)"):
        plugin._after_build_allocator(paged, conf, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=None)


def test_unreadable_cost_model_names_the_path(tmp_path):
    """--granikv-cost-model is read when the attention backend is built (model start-up, before
    serving), not when the flags are parsed: a missing or broken file fails there, by name."""
    from granikv.attention.cost.cost_model import CostModel

    with pytest.raises(ValueError, match="missing.json: cannot read the cost model"):
        CostModel.load(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        CostModel.load(str(broken))
