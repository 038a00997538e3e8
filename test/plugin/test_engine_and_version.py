"""The offline API and the version gate on the running SGLang release.

``sglang.Engine(enable_granikv=True, granikv_*=...)`` runs in a fresh interpreter through the
real ``Engine.__init__`` (plugins loaded by it, the real ServerArgs: a dataclass on 0.5.17, a
msgspec Struct on 0.5.23) up to the point where it would launch the scheduler processes."""

import json
import subprocess
import sys
import textwrap
from argparse import Namespace

import pytest

from granikv import plugin, server_settings, sglang_compat as compat
from granikv.config import GraniKVConfig

from test_plugin import TINY_LLAMA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)

ENGINE_PROBE = textwrap.dedent(
    """
    import json, pickle, sys
    import sglang
    from sglang.srt.entrypoints.engine import Engine

    class Launch(Exception):
        pass

    def launch(*args, server_args=None, **kwargs):
        raise Launch(server_args)

    Engine._launch_subprocesses = staticmethod(launch)  # stop where the processes would start
    for kwargs in json.loads(sys.argv[1]):
        try:
            sglang.Engine(**kwargs)
            out = {"ok": False, "error": "no launch"}
        except Launch as e:
            sa = pickle.loads(pickle.dumps(e.args[0]))  # as sent to the schedulers
            out = {"ok": True, "cfg": sa._granikv.to_mapping(), "radix": sa.radix_cache_backend,
                   "page_size": sa.page_size}
        except Exception as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("PROBE " + json.dumps(out), flush=True)
    """
)


def test_engine_keywords_reach_the_schedulers_server_args(model_dir):
    base = {"model_path": model_dir, "device": "cpu", "skip_tokenizer_init": True}
    argvs = [
        {**base, "enable_granikv": True, "granikv_hot_min_tokens": 2048, "page_size": 4},
        base,
        {**base, "enable_granikv": True, "granikv_hot_min_tokens": 0},
    ]
    proc = subprocess.run([sys.executable, "-c", ENGINE_PROBE, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300)
    rows = [json.loads(l[6:]) for l in proc.stdout.splitlines() if l.startswith("PROBE ")]
    assert len(rows) == len(argvs), proc.stdout[-2000:] + proc.stderr[-4000:]
    on, off, bad = rows
    assert on["ok"], on
    assert on["cfg"]["enable_granikv"] and on["cfg"]["granikv_hot_min_tokens"] == 2048
    assert on["radix"] == "granikv" and on["page_size"] == 1
    assert off["ok"] and not off["cfg"]["enable_granikv"] and off["radix"] in (None, "radix")
    assert not bad["ok"] and "--granikv-hot-min-tokens=0" in bad["error"], bad


def _from_cli(values: dict):
    args = Namespace(radix_cache_backend=None, page_size=None, disable_radix_cache=False,
                     **values)
    built = {}

    def orig(cls, a):
        built.update(vars(a))
        return type("SA", (), {})()

    sa = plugin._around_from_cli_args(orig, object, args)
    return sa._granikv, built


def test_an_untested_release_turns_granikv_off_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(compat, "sglang_version", lambda: "0.6.0")
    monkeypatch.setattr(server_settings, "_warned", set())
    for _ in range(2):
        cfg, built = _from_cli({"enable_granikv": True})
        assert not cfg.enable and built["radix_cache_backend"] is None  # stock SGLang serves
    warnings = [r for r in caplog.records if "not a tested release" in r.getMessage()]
    assert len(warnings) == 1 and "GraniKV is OFF" in warnings[0].getMessage()
    assert "--granikv-allow-untested-sglang" in warnings[0].getMessage()


def test_allow_untested_sglang_keeps_granikv_on(monkeypatch, caplog):
    monkeypatch.setattr(compat, "sglang_version", lambda: "0.6.0")
    monkeypatch.setattr(server_settings, "_warned", set())
    cfg, built = _from_cli({"enable_granikv": True, "granikv_allow_untested_sglang": True})
    assert cfg.enable and built["radix_cache_backend"] == "granikv"
    assert any("running anyway" in r.getMessage() for r in caplog.records)


def test_a_tested_release_logs_its_version(caplog):
    caplog.set_level("INFO", logger="granikv")
    cfg, _ = _from_cli({"enable_granikv": True})
    assert cfg.enable
    assert any(f"on SGLang {compat.sglang_version()}" in r.getMessage() for r in caplog.records)
    assert not any("not a tested release" in r.getMessage() for r in caplog.records)


def test_engine_factory_builds_with_the_config_attached():
    seen = {}

    class FakeServerArgs:
        def __init__(self, **kw):
            seen.update(kw)

    sa = plugin._build_engine_server_args(FakeServerArgs, model_path="m", enable_granikv=True,
                                          granikv_hot_min_tokens=2048, page_size=4)
    assert seen == {"model_path": "m", "page_size": 1, "radix_cache_backend": "granikv"}
    assert sa._granikv == GraniKVConfig(enable=True, hot_min_tokens=2048)
