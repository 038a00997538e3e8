"""CPU tests of the end-to-end correctness check (benchmark/correctness): the agreement
measures and pass rule, the checkpoint writer (a tiny shape, loaded back by transformers), the
rows and report, and the parent end to end with a fake ``sglang`` (no GPU, no SGLang)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmark" / "correctness"
sys.path.insert(0, str(CHECK))
sys.path.insert(1, str(ROOT / "benchmark" / "multi_agent"))

import check  # noqa: E402
import checkpoint  # noqa: E402
import metrics  # noqa: E402
import results  # noqa: E402


# ---- metrics -------------------------------------------------------------------------------


def test_compare_stops_at_each_first_difference():
    a = metrics.Outputs(ids=[[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]],
                        logprobs=[[-1.0, -2.0, -3.0, -4.0], [-1.0] * 4, [-0.5, None]])
    b = metrics.Outputs(ids=[[1, 2, 0, 4], [0, 6, 7, 8], [9, 9]],
                        logprobs=[[-1.5, -2.0, -3.0, -4.0], [-1.0] * 4, [-0.25, -1.0]])
    c = metrics.compare(a, b)
    assert c.agreement == pytest.approx((2 + 0 + 2) / 10)  # token 3 of request 0 agrees: not counted
    assert c.first_token_agreement == pytest.approx(2 / 3)
    assert c.compared_tokens == 3  # request 0: 2 positions, request 2: 1 (the other has None)
    assert c.logprob_dev_mean == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert metrics.compare(a, a).agreement == 1.0 and metrics.compare(a, a).logprob_dev_mean == 0.0
    # per-request shares 0.5, 0.0, 1.0: sd 0.5, over sqrt(3) requests
    assert c.agreement_stderr == pytest.approx(0.5 / 3 ** 0.5)
    assert metrics.compare(a, a).agreement_stderr == 0.0
    one = metrics.Outputs(ids=[[1]], logprobs=[[None]])
    assert metrics.compare(one, one).agreement_stderr is None
    with pytest.raises(ValueError, match="not the same prompts"):
        metrics.compare(a, metrics.Outputs(ids=[[1]], logprobs=[[None]]))


def test_pass_rule_fails_far_from_the_reference():
    ref = metrics.Comparison(agreement=0.48, first_token_agreement=1.0, logprob_dev_mean=0.014,
                             compared_tokens=100)
    ok = metrics.Comparison(0.45, 1.0, 0.02, 100)
    assert metrics.passes(ok, ref)
    assert not metrics.passes(metrics.Comparison(0.42, 1.0, 0.02, 100), ref)  # agreement
    assert not metrics.passes(metrics.Comparison(0.5, 0.9, 0.02, 100), ref)  # first token
    assert not metrics.passes(metrics.Comparison(0.5, 1.0, 0.08, 100), ref)  # logprobs
    assert metrics.passes(metrics.Comparison(0.5, 1.0, None, 0), ref)  # agreement alone decides


# ---- checkpoint ------------------------------------------------------------------------------


def test_checkpoint_loads_as_a_real_llama_and_depends_on_context(tmp_path):
    transformers = pytest.importorskip("transformers")
    shape = checkpoint.LlamaShape(num_layers=2, hidden=64, intermediate=96, num_q_heads=4,
                                  num_kv_heads=2, head_dim=16, vocab=97, max_positions=256)
    path = checkpoint.write_checkpoint(str(tmp_path / "m"), shape, seed=3, dtype="float32")
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shape.tensor_shapes()
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 0.02) < 0.002 and abs(float(q.mean())) < 0.002
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64))
    again = load_file(str(checkpoint.write_checkpoint(str(tmp_path / "m2"), shape, seed=3,
                                                      dtype="float32") / "model.safetensors"))
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)  # seeded: same bytes

    model = transformers.LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    model.eval()
    tail = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = model(torch.cat([torch.tensor([[11] * 32]), tail], 1)).logits[0, -1]
        b = model(torch.cat([torch.tensor([[42] * 32]), tail], 1)).logits[0, -1]
    # same last tokens, different earlier context: the next-token distribution moves
    assert float((a - b).abs().max()) > 0.1 * float(a.abs().max())


def test_checkpoint_shape_errors():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        checkpoint.LlamaShape(num_q_heads=32, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab=0"):
        checkpoint.LlamaShape(vocab=0)


# ---- workloads at check size ------------------------------------------------------------------


def test_workloads_fit_the_vocabulary_and_keep_sharing():
    for spec in check.specs(8):
        w = check.fit_vocab(spec.build(), 4096)
        ids = [t for p in w.prompts for t in p]
        assert min(ids) >= check.VOCAB_LO and max(ids) < 4096
        for i, p in enumerate(w.prompts):
            if w.group[i] >= 0:
                prefix = w.prefixes[w.group[i]]
                assert p[:len(prefix)] == prefix and len(prefix) >= 1024  # HOT-eligible
    loop = check.fit_vocab(check.specs(8)[2].build(), 4096)
    assert loop.turns == 3
    assert check.between_turns(loop, 1, 0, 4096) == check.between_turns(loop, 1, 0, 4096)
    assert check.between_turns(loop, 1, 0, 4096) != check.between_turns(loop, 2, 0, 4096)


def test_scale_multiplies_the_agents_of_every_workload():
    base, big = check.specs(8), check.specs(8, 4)
    assert [s.agents * 4 for s in base] == [s.agents for s in big]
    assert [s.prefix_len for s in base] == [s.prefix_len for s in big]
    assert check.parse_args([]).scale == 4
    with pytest.raises(ValueError, match="scale=0"):
        check.specs(8, 0)


# ---- rows and report --------------------------------------------------------------------------


def _engine(ids, lp=-1.0, steps=None):
    att = None if steps is None else {"attention": {"steps_per_path": steps, "extend_hot_batches": 0}}
    return {"workloads": {"homogeneous": {
        "outputs": {"ids": ids, "logprobs": [[lp] * len(x) for x in ids]}, "granikv_delta": att}}}


def test_rows_flag_a_fault_and_a_silent_fast_path():
    ref = [[1, 2, 3, 4]] * 4
    cross = [[1, 2, 3, 0]] * 4
    engines = {("flashinfer", "baseline"): _engine(ref), ("triton", "baseline"): _engine(cross),
               ("flashinfer", "granikv"): _engine(ref, -1.001, {"cascade": 5}),
               ("flashinfer", "fault"): _engine([[1, 9, 9, 9]] * 4, -1.0, {"cascade": 5}),
               ("triton", "granikv"): _engine(cross, -1.0, {"paged": 5}),
               ("triton", "fault"): _engine(cross, -1.0, {"paged": 5})}
    rs = {r["backend"]: r for r in results.rows(engines, ["homogeneous"], ["flashinfer", "triton"])}
    fi, tr = rs["flashinfer"], rs["triton"]
    assert fi["granikv_vs_baseline_agreement"] == 1.0 and fi["cross_backend_agreement"] == 0.75
    assert fi["passed"] and fi["planted_fault_caught"] and fi["granikv_fast_path_ran"]
    assert fi["fault_agreement"] == 0.25 and fi["logprob_dev_mean"] == pytest.approx(0.001)
    # triton's GraniKV engine agrees, but only because its kernels never ran: fault not caught
    assert tr["passed"] and not tr["granikv_fast_path_ran"] and tr["planted_fault_caught"] is False
    meta = {"errors": [], "model": {}}
    assert not results.all_ok(meta, list(rs.values()), fault=True)
    assert results.all_ok(meta, [fi], fault=True)
    assert not results.all_ok(dict(meta, errors=["triton/fault: boom"]), [fi], fault=True)
    md = results.markdown(meta, list(rs.values()))
    assert "| homogeneous | flashinfer | 4 | 1.000 | 0.750 |" in md and "**no**" in md


def test_rows_with_a_missing_engine_leave_columns_empty():
    engines = {("triton", "baseline"): _engine([[1, 2]])}
    (r,) = results.rows(engines, ["homogeneous"], ["triton"])
    assert r["granikv_vs_baseline_agreement"] is None and r["cross_backend_agreement"] is None
    assert r["passed"] is None and r["planted_fault_caught"] is None
    assert not results.all_ok({"errors": []}, [r], fault=True)


# ---- parent end to end, children importing a fake sglang -----------------------------------------


FAKE_SGLANG = textwrap.dedent('''
    import asyncio, os
    class Engine:
        def __init__(self, **kw):
            self.kw, self.calls = kw, 0
            self.loop = asyncio.new_event_loop()
            tm = type("TM", (), {})()
            async def flush_cache(): return None
            tm.flush_cache = flush_cache
            self.tokenizer_manager = tm
            self.fault = bool(os.environ.get("GRANIKV_DEBUG_FAULT"))
        def _one(self, ids, n):
            h = sum(ids) * 31 + len(ids)
            out = [(h + 7 * k) % 4000 for k in range(n)]
            if self.kw["attention_backend"] == "triton":
                out[-2:] = [1, 1]  # a second correct kernel diverges late
            if self.fault:
                out[1:] = [2] * (n - 1)
            lp = -1.0005 if self.kw.get("enable_granikv") else -1.0
            return {"output_ids": out, "meta_info": {"output_token_logprobs": [(lp, t, None) for t in out]}}
        def generate(self, input_ids, sampling_params, return_logprob=False):
            self.calls += 1
            return [self._one(p, sampling_params["max_new_tokens"]) for p in input_ids]
        async def async_generate(self, input_ids, sampling_params, return_logprob=False):
            self.calls += 1
            return self._one(input_ids, sampling_params["max_new_tokens"])
        def get_server_info(self):
            st = {}
            if self.kw.get("enable_granikv"):
                st["granikv"] = {"attention": {"steps_per_path": {"cascade": self.calls},
                                               "extend_hot_batches": 0, "unplanned_steps": 0}}
            return {"internal_states": [st]}
        def shutdown(self): pass
''')


def test_parent_end_to_end_with_fake_engine(tmp_path):
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_SGLANG)
    (tmp_path / "model").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    env.pop("GRANIKV_DEBUG_FAULT", None)
    out = tmp_path / "out"
    cmd = [sys.executable, str(CHECK / "check.py"), "--model-dir", str(tmp_path / "model"),
           "--out-tokens", "8", "--scale", "1", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "correctness.json").read_text())
    assert {(r["workload"], r["backend"]) for r in doc["rows"]} == {
        (w, b) for w in ("homogeneous", "heterogeneous", "agent_loop") for b in ("flashinfer", "triton")}
    for r in doc["rows"]:
        n = 4 if r["workload"] == "agent_loop" else 8  # the agent loop's turns are half as long
        assert r["granikv_vs_baseline_agreement"] == 1.0
        assert r["cross_backend_agreement"] == pytest.approx((n - 2) / n)  # triton: last 2 differ
        assert r["passed"] and r["planted_fault_caught"] and r["granikv_fast_path_ran"]
        assert r["fault_agreement"] == pytest.approx(1 / n)
    loop = next(r for r in doc["rows"] if r["workload"] == "agent_loop")
    assert loop["requests"] == 8 * 3  # one entry per agent and turn
    assert (out / "correctness.md").read_text().startswith("# Correctness")

    # the fault engines skipped: no fault column, and the run still passes
    res = subprocess.run(cmd[:-1] + [str(tmp_path / "out2"), "--no-fault", "--backends", "triton"],
                         env=env, capture_output=True, text=True, timeout=180)
    doc = json.loads((tmp_path / "out2" / "correctness.json").read_text())
    assert res.returncode == 1  # one backend: no cross-backend reference, nothing can pass
    assert all(r["passed"] is None for r in doc["rows"])
