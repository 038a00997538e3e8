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

from benchmark.correctness import check, checkpoint, metrics, results

ROOT = Path(__file__).resolve().parents[2]


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
    # per-request (agreeing, tokens) (2, 4), (0, 4), (2, 2): the bootstrap resamples those
    assert c.per_request == ((2, 4), (0, 4), (2, 2))
    assert c.agreement_stderr == metrics.bootstrap(c.per_request)[0] and 0.1 < c.agreement_stderr < 0.4
    assert c.agreement_ci95[0] < c.agreement < c.agreement_ci95[1]
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


def _per(shares):
    """Requests of 10 output tokens agreeing on ``round(10 * share)`` of them."""
    return [(round(10 * x), 10) for x in shares]


def test_bootstrap_on_known_inputs():
    assert metrics.bootstrap(_per([1.0] * 64)) == (0.0, (1.0, 1.0))  # all agree: no noise
    se, (lo, hi) = metrics.bootstrap(_per([1.0, 0.0] * 32))  # 50/50: ~0.5 / sqrt(n)
    assert se == pytest.approx(0.5 / 64 ** 0.5, rel=0.1)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(2 * 1.96 * 0.5 / 8, rel=0.15)
    assert metrics.bootstrap(_per([0.3])) is None  # one request: no stderr
    assert metrics.bootstrap(_per([1.0, 0.0] * 8)) == metrics.bootstrap(_per([1.0, 0.0] * 8))  # seeded
    # token-weighted like ``agreement``: a 30-token request weighs 3x a 10-token one
    assert metrics.bootstrap([(30, 30), (0, 10)] * 50)[1][0] > 0.6
    a = metrics.compare(metrics.Outputs(ids=[[1, 2]] * 32 + [[3, 4]] * 32, logprobs=[[None] * 2] * 64),
                        metrics.Outputs(ids=[[1, 2]] * 64, logprobs=[[None] * 2] * 64))
    assert a.agreement == 0.5 and a.agreement_stderr == pytest.approx(0.5 / 8, rel=0.1)
    assert a.agreement_ci95[0] < 0.5 < a.agreement_ci95[1] and a.per_request[-1] == (0, 2)


def _cmp(shares, first=1.0, lp=0.01):
    per = tuple(_per(shares))
    boot = metrics.bootstrap(per)
    return metrics.Comparison(agreement=sum(n for n, _ in per) / sum(t for _, t in per),
                              first_token_agreement=first, logprob_dev_mean=lp, compared_tokens=100,
                              agreement_stderr=boot[0], agreement_ci95=boot[1], per_request=per)


def test_paired_difference_stderr():
    ref = _cmp([1.0, 0.0] * 32)
    assert metrics.difference_stderr(ref, ref) == 0.0  # the same requests: no difference at all
    flipped = _cmp([0.0, 1.0] * 32)  # same agreement, opposite requests: double the variance
    assert metrics.difference_stderr(flipped, ref) == pytest.approx(2 * ref.agreement_stderr, rel=0.1)
    legacy = metrics.Comparison(0.5, 1.0, 0.01, 10, agreement_stderr=0.03)
    assert metrics.difference_stderr(legacy, metrics.Comparison(0.5, 1.0, 0.01, 10, agreement_stderr=0.04)) \
        == pytest.approx(0.05)
    assert metrics.difference_stderr(legacy, metrics.Comparison(0.5, 1.0, 0.01, 10)) is None


def test_token_rule_widens_the_margin_to_z_stderrs():
    ref = _cmp([1.0, 0.0] * 32)  # cross-backend 0.5, stderr ~0.0625
    assert metrics.agreement_threshold(ref, ref) == pytest.approx(0.5 - 0.05)  # no noise: the margin
    noisy = _cmp([1.0, 0.0, 0.0, 1.0] * 15 + [0.0] * 4)  # 0.469, its requests independent of ref's
    bar = metrics.agreement_threshold(noisy, ref)
    assert metrics.AGREEMENT_Z == 3.0  # one-sided, over the check's 6 rows (metrics' docstring)
    assert bar == pytest.approx(0.5 - 3 * metrics.difference_stderr(noisy, ref)) and bar < 0.45
    assert metrics.token_passes(noisy, ref)  # within the noise
    assert not metrics.token_passes(_cmp([0.1] * 64), ref)  # far below it
    assert not metrics.token_passes(_cmp([1.0, 0.0] * 32, first=0.9), ref)  # first token
    assert not metrics.token_passes(_cmp([1.0, 0.0] * 32, lp=0.08), ref)  # logprobs


def test_layer_rule():
    assert metrics.layer_passes(None) is None  # compare off: not applied
    assert metrics.layer_passes({"compares": 8, "over_tolerance": 0})
    assert not metrics.layer_passes({"compares": 8, "over_tolerance": 1})
    assert not metrics.layer_passes({"compares": 0, "over_tolerance": 0})  # no evidence


def test_check_tolerance_constants_are_the_compare_modules():
    from granikv.attention.debug import compare as debug_compare

    assert (check.TOLERANCE_FACTOR, check.FLOOR_EPS) == (debug_compare.TOLERANCE_FACTOR,
                                                         debug_compare.FLOOR_EPS)


def test_engine_kwargs_turn_the_compare_on_with_eager_decode():
    base = check.engine_kwargs("triton", "baseline", "cascade", 4)
    ours = check.engine_kwargs("triton", "fault", "cascade", 4)
    assert base["disable_cuda_graph"] and ours["disable_cuda_graph"]
    assert ours["granikv_debug_compare_every"] == 4 and "granikv_debug_compare_every" not in base
    off = check.engine_kwargs("triton", "granikv", "cascade", 0)
    assert "disable_cuda_graph" not in off and "granikv_debug_compare_every" not in off
    assert check.parse_args([]).compare_every == 4


def test_granikv_args_reach_the_granikv_engines_only():
    extra = check.granikv_args(["granikv_view_plan=reuse", "granikv-log-interval=0"])
    assert extra == {"granikv_view_plan": "reuse", "granikv_log_interval": 0}
    for config in ("granikv", "fault"):
        kw = check.engine_kwargs("flashinfer", config, "cascade", 0, granikv_extra=extra)
        assert kw["granikv_view_plan"] == "reuse"
    assert "granikv_view_plan" not in check.engine_kwargs("flashinfer", "baseline", "cascade", 0, granikv_extra=extra)
    assert check.parse_args(["--granikv-arg", "granikv_view_plan=reuse"]).granikv_arg == ["granikv_view_plan=reuse"]
    with pytest.raises(SystemExit, match="GraniKV keys only.*mem_fraction_static"):
        check.granikv_args(["mem_fraction_static=0.5"])


def test_memory_kwargs_reach_every_engine_and_reject_bad_values():
    base = check.memory_kwargs(0.9, 262144)
    for config in ("baseline", "granikv", "fault"):
        kw = check.engine_kwargs("triton", config, "cascade", 4, base=base)
        assert kw["mem_fraction_static"] == 0.9 and kw["max_total_tokens"] == 262144
    default = check.engine_kwargs("triton", "granikv", "cascade", 4)
    assert default["mem_fraction_static"] == check.ENGINE_KWARGS["mem_fraction_static"]
    assert "max_total_tokens" not in default and check.memory_kwargs(None, None) == check.ENGINE_KWARGS
    for bad in ((1.0, None), (0.0, None), (None, 0)):
        with pytest.raises(SystemExit, match="must be"):
            check.memory_kwargs(*bad)


def test_one_backend_without_a_second_reference_is_refused_before_any_engine(monkeypatch):
    # the token rule's bar is a second correct kernel: one backend alone would leave every row
    # undecided after minutes of engines (seen on a GPU: "passed" None on every row, exit 1)
    monkeypatch.setattr(check.checkpoint, "write_checkpoint", lambda *a, **k: pytest.fail("engines started"))
    with pytest.raises(SystemExit, match="--backends flashinfer: the token rule needs a second"):
        check.main(["--backends", "flashinfer"])
    with pytest.raises(SystemExit, match="--dequantized-reference needs one backend and --kv-cache-dtype"):
        check.main(["--backends", "flashinfer", "--dequantized-reference"])  # still its own message


# ---- checkpoint ------------------------------------------------------------------------------


def _assert_depends_on_context(model) -> None:
    """Same last tokens after a different earlier context (32 tokens, past a gpt-oss test
    model's 8-token window: its full-attention layer carries it): the next-token logits move."""
    model.eval()
    tail = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = model(torch.cat([torch.tensor([[11] * 32]), tail], 1)).logits[0, -1]
        b = model(torch.cat([torch.tensor([[42] * 32]), tail], 1)).logits[0, -1]
    assert float((a - b).abs().max()) > 0.1 * float(a.abs().max())


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
    _assert_depends_on_context(model)


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


def _engine(ids, lp=-1.0, steps=None, layer=None):
    """An engine's RESULT over "homogeneous"; ``layer`` = (compares, over tolerance, max rel dev,
    tolerance) of its debug compare (None: compare off)."""
    att = None if steps is None else {"attention": {"steps_per_path": steps, "extend_hot_batches": 0}}
    state = None
    if layer is not None:
        n, over, dev, tol = layer
        att["attention"].update(layer_output_compares=n, layer_output_over_tolerance=over,
                                layer_output_f64_references=0)
        state = {"attention": dict(layer_output_compares=n, layer_output_max_rel_dev=dev,
                                   layer_output_stock_max_rel_dev=tol / 4, layer_output_tolerance=tol)}
    return {"workloads": {"homogeneous": {
        "outputs": {"ids": ids, "logprobs": [[lp] * len(x) for x in ids]}, "granikv_delta": att,
        "granikv_state": state}}}


CLEAN_LAYERS = (8, 0, 0.004, 0.016)
FAULT_LAYERS = (8, 8, 0.6, 0.016)


@pytest.mark.parametrize("fault_tokens, fault_layers, caught_by", [
    ([[1, 9, 9, 9]] * 8, FAULT_LAYERS, ["tokens", "layer_output"]),  # both rules reject: caught
    ([[1, 2, 3, 4]] * 8, FAULT_LAYERS, ["layer_output"]),  # tokens look fine: not caught
    ([[1, 9, 9, 9]] * 8, CLEAN_LAYERS, ["tokens"]),  # layer outputs look fine: not caught
])
def test_a_fault_is_caught_only_when_each_rule_rejects_it(fault_tokens, fault_layers, caught_by):
    ref = [[1, 2, 3, 4]] * 8
    engines = {("flashinfer", "baseline"): _engine(ref), ("triton", "baseline"): _engine(ref),
               ("flashinfer", "granikv"): _engine(ref, -1.0, {"cascade": 5}, CLEAN_LAYERS),
               ("flashinfer", "fault"): _engine(fault_tokens, -1.0, {"cascade": 5}, fault_layers)}
    r = results.rows(engines, ["homogeneous"], ["flashinfer", "triton"])[0]
    assert r["passed"] and r["granikv_token_passes"] and r["granikv_layer_passes"]
    assert r["granikv_layer_output_max_rel_dev"] == 0.004 and r["granikv_layer_output_tolerance"] == 0.016
    assert r["granikv_agreement_ci95"] == [1.0, 1.0] and r["cross_agreement_stderr"] == 0.0
    assert r["fault_caught_by"] == caught_by
    assert r["planted_fault_caught"] is (len(caught_by) == 2)
    assert results.all_ok({"errors": []}, [r], fault=True) is (len(caught_by) == 2)
    assert ("caught (rejected by: tokens, layer_output)" if len(caught_by) == 2 else "NOT caught") \
        in results.fault_summary([r])
    md = results.markdown({"errors": [], "model": {}}, [r])
    assert "| 0.004 / 0.016 (8) |" in md
    assert ("| 0.6 / 0.016 (8, 8 over) |" in md) is (fault_layers is FAULT_LAYERS)


def test_a_granikv_row_fails_on_each_rule_separately():
    ref = [[1, 2, 3, 4]] * 8
    base = {("flashinfer", "baseline"): _engine(ref), ("triton", "baseline"): _engine(ref)}

    def verdict(tokens, layers):
        engines = {**base, ("flashinfer", "granikv"): _engine(tokens, -1.0, {"cascade": 5}, layers)}
        r = results.rows(engines, ["homogeneous"], ["flashinfer", "triton"])[0]
        return r["passed"], r["granikv_token_passes"], r["granikv_layer_passes"]

    assert verdict(ref, CLEAN_LAYERS) == (True, True, True)
    assert verdict(ref, FAULT_LAYERS) == (False, True, False)  # layer outputs alone
    assert verdict(ref, (0, 0, 0.0, 0.0)) == (False, True, False)  # nothing compared
    assert verdict([[1, 9, 9, 9]] * 8, CLEAN_LAYERS) == (False, False, True)  # tokens alone
    assert verdict(ref, None) == (True, True, None)  # compare off: the tokens decide


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
    # per request (agreeing tokens, output tokens): what re-judging a row under another rule needs
    assert fi["granikv_per_request"] == [[4, 4]] * 4 and fi["fault_per_request"] == [[1, 4]] * 4
    assert fi["cross_per_request"] == [[3, 4]] * 4
    assert fi["granikv_first_token_threshold"] == pytest.approx(1.0 - metrics.AGREEMENT_MARGIN)
    # triton's GraniKV engine agrees, but only because its kernels never ran: fault not caught
    assert tr["passed"] and not tr["granikv_fast_path_ran"] and tr["planted_fault_caught"] is False
    meta = {"errors": [], "model": {}}
    assert not results.all_ok(meta, list(rs.values()), fault=True)
    assert results.all_ok(meta, [fi], fault=True)
    assert not results.all_ok(dict(meta, errors=["triton/fault: boom"]), [fi], fault=True)
    md = results.markdown(meta, list(rs.values()))
    assert "| homogeneous | flashinfer | 4 | 1.000 ± 0.000 | 0.750 ± 0.000 |" in md and "**no**" in md


def test_without_the_debug_compare_the_tokens_decide():
    """--compare-every 0 (graphs on): the engines still report ``layer_output_compares`` = 0, but
    the layer rule is not applied rather than failed; the fault is caught by the tokens alone."""
    ref = [[1, 2, 3, 4]] * 8
    off = (0, 0, 0.0, 0.0)  # what an engine without the compare reports
    engines = {("flashinfer", "baseline"): _engine(ref), ("triton", "baseline"): _engine(ref),
               ("flashinfer", "granikv"): _engine(ref, -1.0, {"cascade": 5}, off),
               ("flashinfer", "fault"): _engine([[1, 9, 9, 9]] * 8, -1.0, {"cascade": 5}, off)}
    r = results.rows(engines, ["homogeneous"], ["flashinfer", "triton"], layer_rule=False)[0]
    assert r["passed"] is True and r["granikv_layer_passes"] is None
    assert r["fault_caught_by"] == ["tokens"] and r["planted_fault_caught"] is True
    meta = {"errors": [], "model": {}, "compare_every": 0, "attention_path": "cascade"}
    assert results.all_ok(meta, [r], fault=True)
    assert "the layer rule is not applied" in results.markdown(meta, [r])
    # with the compare on, comparing nothing still fails the row
    r_on = results.rows(engines, ["homogeneous"], ["flashinfer", "triton"])[0]
    assert r_on["passed"] is False and r_on["granikv_layer_passes"] is False


def test_a_forced_decode_path_that_never_ran_fails_the_check():
    """--attention-path cascade and a row whose decode steps all ran paged (GraniKV served only
    its prefill): the check fails, and the row says why its decode ran paged."""
    ref = [[1, 2, 3, 4]] * 8
    gkv = _engine(ref, -1.0, {"paged": 5, "cascade": 0})
    gkv["workloads"]["homogeneous"]["granikv_delta"]["attention"].update(
        extend_hot_batches=2, decode_steps=5, decode_paged_reasons={"no cascade graph of this batch size": 5})
    engines = {("flashinfer", "baseline"): _engine(ref), ("triton", "baseline"): _engine(ref),
               ("flashinfer", "granikv"): gkv,
               ("flashinfer", "fault"): _engine([[1, 9, 9, 9]] * 8, -1.0, {"cascade": 5})}
    r = results.rows(engines, ["homogeneous"], ["flashinfer", "triton"], layer_rule=False)[0]
    assert r["passed"] and r["granikv_fast_path_ran"] and r["granikv_decode_path_ran"] is False
    meta = {"errors": [], "model": {}, "compare_every": 0}
    assert not results.all_ok(dict(meta, attention_path="cascade"), [r], fault=True)
    assert results.all_ok(dict(meta, attention_path="auto"), [r], fault=True)  # auto may pick paged
    md = results.markdown(dict(meta, attention_path="cascade"), [r])
    assert "| prefill only |" in md
    assert "- homogeneous / flashinfer: no cascade graph of this batch size: 5 (of 5 decode steps)" in md


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
            if os.environ.get("GRANIKV_DEBUG_KV_ROUND") and not os.environ.get("FAKE_ROUNDING_SILENT"):
                print("GraniKV: GRANIKV_DEBUG_KV_ROUND=fp8_e4m3 is set: every layer's K/V is rounded "
                      "through fp8_e4m3 before attention (debug only: a reference for an FP8 KV cache)",
                      flush=True)
        def _one(self, ids, n):
            h = sum(ids) * 31 + len(ids)
            out = [(h + 7 * k) % 4000 for k in range(n)]
            if self.kw["attention_backend"] == "triton":
                out[-2:] = [1, 1]  # a second correct kernel diverges late
            if self.kw.get("triton_attention_num_kv_splits"):
                out[-2:] = [4, 4]  # so does the same kernel with another summation order
            if self.kw.get("kv_cache_dtype") == "fp8_e4m3":
                out[-3:] = [5, 5, 5]  # stock's own FP8 decode diverges from the exact FP8 values
                if self.kw.get("enable_granikv"):
                    out[-3:] = [3, 3, 3]
            if os.environ.get("GRANIKV_DEBUG_KV_ROUND") == "fp8_e4m3" and self.kw.get("enable_granikv"):
                out[-3:] = [3, 3, 3] if self.kw["attention_backend"] == "triton" else [3, 1, 1]
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
                att = {"steps_per_path": {"cascade": self.calls}, "extend_hot_batches": 0,
                       "unplanned_steps": 0}
                if self.kw.get("granikv_debug_compare_every"):
                    att.update(layer_output_compares=4 * self.calls,
                               layer_output_over_tolerance=4 * self.calls if self.fault else 0,
                               layer_output_f64_references=0,
                               layer_output_max_rel_dev=0.5 if self.fault and self.calls else 0.003,
                               layer_output_stock_max_rel_dev=0.002, layer_output_tolerance=0.0156)
                st["granikv"] = {"attention": att}
            return {"internal_states": [st]}
        def shutdown(self): pass
''')


def _fake_check(tmp_path):
    """The environment whose children import FAKE_SGLANG, and the check's command up to its
    options (an empty model folder: no checkpoint is written)."""
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_SGLANG)
    (tmp_path / "model").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    env.pop("GRANIKV_DEBUG_FAULT", None)
    return env, [sys.executable, "-m", "benchmark.correctness.check", "--model-dir", str(tmp_path / "model"),
                 "--out-tokens", "8", "--scale", "1"]


def test_parent_end_to_end_with_fake_engine(tmp_path):
    env, cmd = _fake_check(tmp_path)
    out = tmp_path / "out"
    cmd += ["--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
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
        assert r["fault_caught_by"] == ["tokens", "layer_output"]
        assert r["granikv_layer_output_compares"] > 0 and r["granikv_layer_output_over_tolerance"] == 0
        assert r["granikv_layer_output_max_rel_dev"] == 0.003 and r["fault_layer_output_max_rel_dev"] == 0.5
        assert r["granikv_layer_output_tolerance"] == 0.0156 and len(r["cross_agreement_ci95"]) == 2
    assert doc["meta"]["compare_every"] == 4 and doc["meta"]["bootstrap_resamples"] == 2000
    assert "planted fault:" in res.stdout and "NOT caught" not in res.stdout
    loop = next(r for r in doc["rows"] if r["workload"] == "agent_loop")
    assert loop["requests"] == 8 * 3  # one entry per agent and turn
    assert (out / "correctness.md").read_text().startswith("# Correctness")

    # one backend and no second reference: refused before any engine starts, no results written
    res = subprocess.run(cmd[:-1] + [str(tmp_path / "out2"), "--no-fault", "--backends", "triton"],
                         env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert res.returncode != 0 and "the token rule needs a second correct reference" in res.stderr
    assert not (tmp_path / "out2" / "correctness.json").exists()

    # one backend over an FP8 cache: the token rule's references are stock flashinfer and triton
    # over the K/V rounded through FP8 (dequantized engines)
    fp8 = cmd[:-1] + [str(tmp_path / "out3"), "--backends", "triton", "--kv-cache-dtype", "fp8_e4m3",
                      "--dequantized-reference"]
    res = subprocess.run(fp8, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "out3" / "correctness.json").read_text())
    assert doc["meta"]["dequantized_reference"] == ["flashinfer", "triton"]
    assert doc["meta"]["kv_cache_dtype"] == "fp8_e4m3"
    for r in doc["rows"]:
        n = 4 if r["workload"] == "agent_loop" else 8
        assert r["cross_backend"] == "triton vs flashinfer, both stock over the dequantized KV"
        assert r["cross_backend_agreement"] == pytest.approx((n - 2) / n)  # the dequantized pair
        assert r["granikv_vs_baseline_agreement"] == 1.0  # the exact FP8 values, as the reference
        assert r["granikv_vs_stock_agreement"] == pytest.approx((n - 3) / n)  # stock FP8 decode rounds more
        assert r["passed"] and r["planted_fault_caught"] and r["fault_caught_by"] == ["tokens", "layer_output"]
    assert "GRANIKV_DEBUG_KV_ROUND" in (tmp_path / "out3" / "correctness.md").read_text()
    # planted: a reference engine whose backend never rounded (no start-up line) fails the run
    silent = subprocess.run(fp8[:-6] + [str(tmp_path / "out5")] + fp8[-5:], env=dict(env, FAKE_ROUNDING_SILENT="1"),
                            capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert silent.returncode == 1
    errors = json.loads((tmp_path / "out5" / "correctness.json").read_text())["meta"]["errors"]
    assert len(errors) == 2 and all("never said the K/V are rounded" in e for e in errors)
    for extra in (["--backends", "flashinfer,triton"], ["--backends", "triton", "--kv-cache-dtype", "auto"]):
        bad = subprocess.run(cmd[:-1] + [str(tmp_path / "out4"), "--kv-cache-dtype", "fp8_e4m3", *extra,
                                          "--dequantized-reference"],
                             env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
        assert bad.returncode != 0 and "--dequantized-reference needs one backend" in bad.stdout + bad.stderr


def test_a_one_backend_hybrid_model_is_checked_against_another_kv_split_count(tmp_path):
    """``--model gpt-oss``: SGLang serves it on triton only, so the token rule's second correct
    kernel is stock triton with another decode KV split count (the SPLITS engine); every engine
    runs without SGLang's hybrid SWA pool. Another backend is refused, naming the flag."""
    env, cmd = _fake_check(tmp_path)
    cmd += ["--model", "gpt-oss", "--backends", "triton", "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "correctness.json").read_text())
    assert doc["meta"]["splits_reference"] == {"triton_attention_num_kv_splits": check.SPLITS_KV_SPLITS}
    assert doc["meta"]["model"]["architecture"] == "GptOssForCausalLM"
    for r in doc["rows"]:
        n = 4 if r["workload"] == "agent_loop" else 8
        assert r["cross_backend"] == "triton vs triton with another KV split count"
        assert r["cross_backend_agreement"] == pytest.approx((n - 2) / n)
        assert r["passed"] and r["planted_fault_caught"] and r["fault_caught_by"] == ["tokens", "layer_output"]
    bad = subprocess.run(cmd[:-1] + [str(tmp_path / "out2"), "--backends", "flashinfer,triton"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "--model gpt-oss is served on --backends triton only" in bad.stdout + bad.stderr
    for config in ("baseline", "granikv", "fault", "splits"):
        kw = check.engine_kwargs("triton", config, "cascade", 4, model="gpt-oss")
        assert kw["disable_hybrid_swa_memory"] is True
        assert ("triton_attention_num_kv_splits" in kw) == (config == "splits")
    assert "disable_hybrid_swa_memory" not in check.engine_kwargs("triton", "baseline", "cascade", 4)


def test_the_gpt_oss_checkpoint_loads_as_a_real_gpt_oss_and_depends_on_context(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no GptOss")
    shape = checkpoint.GptOssShape(num_layers=2, hidden=64, intermediate=64, num_q_heads=4, num_kv_heads=2,
                                   head_dim=16, num_experts=4, experts_per_token=2, window=8, vocab=97,
                                   max_positions=256)
    assert shape.layer_types == ("sliding_attention", "full_attention")
    path = checkpoint.write_checkpoint(str(tmp_path / "m"), shape, seed=3, dtype="float32")
    model = transformers.GptOssForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shape.tensor_shapes()
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.bias"], torch.zeros(64))
    assert float(tensors["model.layers.1.self_attn.sinks"].abs().max()) > 0.1  # N(0, 1), not the matrices' 0.02
    assert abs(float(tensors["model.layers.1.mlp.experts.down_proj"].std()) - 0.02) < 0.002
    _assert_depends_on_context(model)
    with pytest.raises(ValueError, match="experts_per_token=5"):
        checkpoint.GptOssShape(num_experts=4, experts_per_token=5)


def test_the_qwen3_moe_checkpoint_loads_as_a_real_qwen3_moe_and_depends_on_context(tmp_path):
    """Written in the released checkpoints' per-expert layout; transformers reads it into its own
    (fused experts) with no missing or unexpected tensor, and the logits depend on the context."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        pytest.skip("this transformers has no Qwen3Moe")
    shape = checkpoint.Qwen3MoeShape(num_layers=2, hidden=64, moe_intermediate=32, num_q_heads=8, num_kv_heads=1,
                                     head_dim=16, num_experts=4, experts_per_token=2, vocab=97, max_positions=256)
    path = checkpoint.write_checkpoint(str(tmp_path / "m"), shape, seed=5, dtype="float32")
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == set(shape.tensor_shapes()) and len(tensors) == 3 + 2 * (9 + 3 * 4)
    assert torch.equal(tensors["model.layers.0.self_attn.k_norm.weight"], torch.ones(16))  # q/k norms: unit
    written = torch.stack([tensors[f"model.layers.1.mlp.experts.{j}.down_proj.weight"] for j in range(4)])
    sd = model.state_dict()  # the experts fused or one by one, as this transformers holds them
    fused = sd.get("model.layers.1.mlp.experts.down_proj")
    held = fused if fused is not None else torch.stack(
        [sd[f"model.layers.1.mlp.experts.{j}.down_proj.weight"] for j in range(4)])
    assert torch.equal(held, written)  # the written experts, not transformers' own init
    _assert_depends_on_context(model)
    assert checkpoint.SHAPES["qwen3-moe"] is checkpoint.Qwen3MoeShape
    with pytest.raises(ValueError, match="experts_per_token=3"):
        checkpoint.Qwen3MoeShape(num_experts=2, experts_per_token=3)


def test_the_report_says_how_each_row_prefilled():
    from benchmark.correctness import results

    rows_ = [dict(workload="heterogeneous", backend="triton", granikv_attention=dict(
                 extend_batches=5, extend_hot_batches=3, extend_fallbacks={"no HOT prefix in the batch": 2})),
             dict(workload="homogeneous", backend="triton", granikv_attention=dict(extend_batches=0)),
             dict(workload="agent_loop", backend="triton", granikv_attention=None)]
    assert results.prefill_lines(rows_) == [
        "- heterogeneous / triton: over HOT extents in 3 of 5 extend batches; left stock: "
        "no HOT prefix in the batch: 2"]


def test_kv_round_formats_are_the_debug_modules():
    from granikv.attention.debug import kv_round

    assert set(check.KV_ROUND_FORMATS) == set(kv_round.FORMATS) and check.KV_ROUND_MARK == kv_round.LOG_MARK
    assert check.engine_kwargs("flashinfer", "dequantized", "cascade", 4)["granikv_attention_path"] == "paged"


def test_every_engine_of_an_fp8_check_gets_the_same_kv_cache_dtype():
    """``--kv-cache-dtype fp8_e4m3``: GraniKV against stock over the same FP8 cache (both
    engines, the planted-fault one too); without it the engines keep the model's dtype."""
    for config in ("baseline", "granikv", "fault"):
        assert check.engine_kwargs("triton", config, "cascade", 0, "fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
        assert "kv_cache_dtype" not in check.engine_kwargs("triton", config, "cascade")
    assert check.parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"


def _firsts(agree):
    """Requests of 10 output tokens whose first token agrees where ``agree`` (then all 10)."""
    per = tuple((10 if a else 0, 10) for a in agree)
    boot = metrics.bootstrap(per)
    return metrics.Comparison(agreement=sum(n for n, _ in per) / sum(t for _, t in per),
                              first_token_agreement=sum(agree) / len(agree), logprob_dev_mean=0.01,
                              compared_tokens=100, agreement_stderr=boot[0], agreement_ci95=boot[1],
                              per_request=per)


def test_first_token_clause_widens_to_its_paired_stderr():
    """16 requests: a correct engine that flips two more prefill near-ties than stock-vs-stock
    (0.8125 against 0.9375, 0.125 below: more than the 0.05 margin) is within the noise; one
    whose prefill is wrong (first tokens mostly differ) is not, whatever the request count."""
    ref = _firsts([True] * 15 + [False])
    two_more = _firsts([True] * 13 + [False] * 3)
    se = metrics.first_token_difference_stderr(two_more, ref)
    assert se is not None and 0.05 < se < 0.15
    assert metrics.first_token_threshold(two_more, ref) == pytest.approx(0.9375 - 3 * se)
    assert two_more.first_token_agreement < ref.first_token_agreement - metrics.AGREEMENT_MARGIN  # the old clause
    assert metrics.token_passes(two_more, ref)
    wrong = _firsts([True] * 3 + [False] * 13)
    assert wrong.first_token_agreement < metrics.first_token_threshold(wrong, ref)
    many_ref, many_wrong = _firsts([True] * 480 + [False] * 32), _firsts([True] * 440 + [False] * 72)
    # 512 requests: 0.078 below is significant
    assert many_wrong.first_token_agreement < metrics.first_token_threshold(many_wrong, many_ref)
    assert metrics.first_token_difference_stderr(ref, ref) == 0.0  # the same requests: the margin alone
    assert metrics.first_token_threshold(ref, ref) == pytest.approx(0.9375 - metrics.AGREEMENT_MARGIN)
    # a comparison whose per-request data does not give its share (built by hand): the margin alone
    hand = metrics.Comparison(0.5, 0.9, 0.01, 100, per_request=((10, 10), (0, 10)))
    assert metrics.first_token_difference_stderr(hand, ref) is None


@pytest.mark.parametrize("parallel", [1, 3])
def test_parallel_engines_overlap_and_keep_the_runs_order(monkeypatch, tmp_path, parallel):
    """``--parallel N``: up to N engines at once (their start-ups overlap), under the memory
    defaults for sharing one GPU unless given; the rows, the errors and the verdict are those of
    the same engines run one after another."""
    import threading
    import time as time_mod

    live, peak, started, lock = [0], [0], [], threading.Lock()

    def fake_run_engine(backend, config, job, timeout, kv_round=None):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            started.append((backend, config))
            kw = job["engine_kwargs"]
        time_mod.sleep(0.2)
        with lock:
            live[0] -= 1
        if (backend, config) == ("triton", "fault"):
            raise RuntimeError("boom")
        assert (kw["mem_fraction_static"], kw.get("max_total_tokens")) == (
            (0.9, 262144) if parallel > 1 else (check.ENGINE_KWARGS["mem_fraction_static"], None))
        ids = [[1, 2, 3, 4]] * 4 if config != "fault" else [[1, 9, 9, 9]] * 4
        att = {"attention": {"steps_per_path": {"cascade": 5}, "extend_hot_batches": 1}}
        return {"workloads": {s["name"]: {"outputs": {"ids": ids, "logprobs": [[-1.0] * 4] * 4},
                                          "granikv_delta": None if config == "baseline" else att,
                                          "granikv_state": None} for s in job["specs"]},
                "kv_rounded": False, "gpu": "fake"}

    monkeypatch.setattr(check, "run_engine", fake_run_engine)
    t0 = time_mod.time()
    code = check.main(["--out", str(tmp_path), "--model-dir", str(tmp_path / "model"), "--scale", "1",
                       "--compare-every", "0", "--parallel", str(parallel)])
    took = time_mod.time() - t0
    assert code == 1  # one engine failed: the run fails, whatever its rows say
    doc = json.loads((tmp_path / "correctness.json").read_text())
    assert doc["meta"]["parallel"] == parallel and doc["meta"]["errors"] == ["triton/fault: RuntimeError: boom"]
    assert peak[0] == min(parallel, 6) and len(started) == 6
    if parallel == 1:
        assert started == [(b, c) for b in ("flashinfer", "triton") for c in check.CONFIGS]  # in order
    else:
        assert took < 6 * 0.2  # overlapped
    fi = [r for r in doc["rows"] if r["backend"] == "flashinfer"]
    assert all(r["passed"] and r["planted_fault_caught"] for r in fi)
    with pytest.raises(SystemExit, match="--parallel 0 must be >= 1"):
        check.main(["--out", str(tmp_path), "--parallel", "0"])
