"""calibrate.py's CPU parts: rebuilding the calibration workloads from a checked-in file's
measurements, the data-driven choice of disabled paths, and the offline refit."""

import dataclasses
import json
from pathlib import Path

import pytest

from benchmark.kernels import calibrate as cal
from granikv.attention.cost.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[2]

H200 = ROOT / "python" / "granikv" / "data" / "cost_model_nvidia-h200.json"


def _rows():
    return cal.rows_from(json.loads(H200.read_text())["calibration"])


def test_checked_in_h200_model_never_picks_below_paged_on_its_measurements():
    rows = _rows()
    assert len(rows) == len(json.loads(H200.read_text())["calibration"]["cases"]) >= 19
    d = cal.decisions(rows, CostModel.load(str(H200)))
    assert min(x["speedup_vs_paged"] for x in d) >= 0.97
    assert any(x["pick"] == "cascade" for x in d)  # not a model that only ever says "paged"


def test_choose_disabled_drops_a_path_whose_picks_lose():
    rows = _rows()
    model = dataclasses.replace(CostModel.load(str(H200)), disabled_paths=())
    # make fused look fast to the model but measure it 3x slower than paged everywhere
    model = dataclasses.replace(model, fused_tflops=1e9)
    slow = [(label, n, dict(m, fused=3 * m["paged"]), w) for label, n, m, w in rows]
    assert any(x["pick"] == "fused" for x in cal.decisions(slow, model))
    disabled = cal.choose_disabled(slow, model)
    assert "fused" in disabled and "cascade" not in disabled
    assert min(x["speedup_vs_paged"] for x in cal.decisions(slow, dataclasses.replace(
        model, disabled_paths=disabled))) >= 0.97


def test_refit_from_writes_a_loadable_model(tmp_path):
    out = tmp_path / "model.json"
    assert cal.refit_from(str(H200), str(out)) == 0
    model = CostModel.load(str(out))
    meta = json.loads(out.read_text())["calibration"]
    assert meta["refit"]["from"] == H200.name
    assert len(meta["cases"]) == len(json.loads(H200.read_text())["calibration"]["cases"])
    assert min(x["speedup_vs_paged"] for x in meta["decisions_num_layers_32"]) >= 0.97
    assert model.plan_us == CostModel.load(str(H200)).plan_us


def test_rows_from_rejects_another_case_set():
    """Cases are matched by label: a calibration from before a case was added loads (the
    checked-in files lack the forest cases), a case CASES does not know is refused."""
    cal_meta = json.loads(H200.read_text())["calibration"]
    labels = [r[0] for r in cal.rows_from(dict(cal_meta, cases=cal_meta["cases"][:-1]))]
    assert labels == [c["case"] for c in cal_meta["cases"][:-1]]
    with pytest.raises(ValueError, match="not the same calibration set"):
        cal.rows_from(dict(cal_meta, cases=cal_meta["cases"] + [dict(cal_meta["cases"][0], case="8x1 sfx1")]))


def test_rows_from_grid_rebuild_the_grid_points(tmp_path):
    grid = {"meta": {"shapes": {"hq": 32, "hkv": 8, "d": 128}},
            "rows": [{"groups": [[4096, 8]], "suffix": 256, "fi_decode_tc_ms": 0.03, "gkv_cascade_ms": 0.027,
                      "gkv_fused_ms": 0.029, "gkv_bgemm_ms": 0.2},
                     {"groups": [[1024, 8]], "suffix": 64, "error": "boom"},
                     {"groups": [[1024, 8]], "suffix": 64, "fi_decode_tc_ms": 0.02, "gkv_cascade_ms": None,
                      "gkv_fused_ms": 0.02, "gkv_bgemm_ms": 0.3}]}
    p = tmp_path / "kernels.json"
    p.write_text(json.dumps(grid))
    rows = cal.rows_from_grid(str(p))
    assert len(rows) == 1
    label, layers, measured, w = rows[0]
    assert label == "grid 4096x8 sfx256" and layers == 1
    assert measured == pytest.approx({"paged": 30.0, "cascade": 27.0, "fused": 29.0, "bgemm": 200.0})
    assert w.num_groups == 1 and w.prefix_bytes == 4096 * 8 * 128 * 2 * 2
    with pytest.raises(ValueError, match="differ"):
        cal.rows_from_grid(str(p), heads=(40, 8, 128))


def test_refit_keeps_the_served_step_terms_and_takes_overrides(tmp_path):
    """A refit keeps every served term of the file (per-backend paged coefficients, extend
    terms, a backend's own prefill terms, launch floor, host planning prior, how they were
    derived); --launch-floor-us / --host-plan-us replace theirs (checked: positive microseconds)."""
    out = tmp_path / "model.json"
    doc = json.loads(H200.read_text())
    doc["served"]["extend_stock_by_backend"] = {"fa3": {"paged_tflops": 555.0}}
    src = tmp_path / "src.json"
    src.write_text(json.dumps(doc))
    old = CostModel.load(str(src)).served
    assert old.paged_by_backend and old.extend_stock_by_backend
    assert cal.refit_from(str(src), str(out)) == 0
    kept = CostModel.load(str(out)).served
    fi = CostModel.load(str(out))
    assert kept == dataclasses.replace(old, paged_by_backend=dict(old.paged_by_backend, flashinfer={
        n: getattr(fi, n) for n in ("paged_launch_us", "paged_gbps", "paged_reuse_gbps")}))  # the calibrated kernel's
    assert json.loads(out.read_text())["served"]["note"] == doc["served"]["note"]
    assert cal.refit_from(str(src), str(out), overrides=cal.served_overrides(2.5, None)) == 0
    new = CostModel.load(str(out)).served
    assert (new.launch_floor_us, new.host_plan_us) == (2.5, old.host_plan_us)
    with pytest.raises(SystemExit, match="--host-plan-us=-1.0 must be a positive"):
        cal.served_overrides(None, -1.0)


def test_served_terms_take_fa3s_own_stock_prefill_from_extend_json(tmp_path):
    """--served-into: bench_extend's sgl_fa3_paged (SGLang's fa3 call over the prefix) becomes
    served.extend_stock_by_backend.fa3 (median TFLOP/s); without it, no fa3 entry."""
    grid = {"meta": {"shapes": {"hq": 32, "hkv": 8, "d": 128}},
            "rows": [{"groups": [[4096, 8]], "suffix": 256, "sgl_triton_ms": 0.05, "gkv_cascade_ms": 0.027,
                      "gkv_cascade_eager_ms": 0.07}]}
    ext_rows = [{"fi_paged_fa2_TFLOPs": 350.0, "fi_ragged_fa3_TFLOPs": 640.0, "sgl_fa3_paged_TFLOPs": t}
                for t in (480.0, 520.0, 500.0)]
    (tmp_path / "kernels.json").write_text(json.dumps(grid))
    (tmp_path / "extend.json").write_text(json.dumps({"rows": ext_rows}))
    model = CostModel.load(str(H200))
    served, how = cal.served_from_grid(str(tmp_path / "kernels.json"), str(tmp_path / "extend.json"), model)
    assert served.extend_stock_by_backend == {"fa3": {"paged_tflops": 500.0, "paged_call_us": served.extend.paged_call_us}}
    assert served.extend.paged_tflops == 350.0 and "extend_stock_fa3" in how
    for r in ext_rows:
        del r["sgl_fa3_paged_TFLOPs"]
    (tmp_path / "extend.json").write_text(json.dumps({"rows": ext_rows}))
    served, how = cal.served_from_grid(str(tmp_path / "kernels.json"), str(tmp_path / "extend.json"), model)
    assert served.extend_stock_by_backend == {} and "extend_stock_fa3" not in how


def test_refit_with_a_batch_order_run_fits_its_forests_too(tmp_path):
    """--refit-from FILE --with-order RUN: the forests of a batch_order.py run join the samples
    (their paged and cascade times, workloads rebuilt from its SHAPES); a run of other heads or
    an unknown batch is refused."""
    from benchmark.kernels.batch_order import ORDERS, SHAPES

    run = {"meta": {"heads": [32, 8, 128]},
           "rows": [{"shape": name, "order": order, "layers": 2, "paged_us": 100.0 + i, "cascade_us": 80.0 + i}
                    for i, ((name, _, _), (order, _)) in enumerate((s, o) for s in SHAPES for o in ORDERS)]}
    p = tmp_path / "batch_order.json"
    p.write_text(json.dumps(run))
    rows = cal.rows_from_order(str(p))
    assert len(rows) == len(SHAPES) * len(ORDERS)
    label, layers, measured, w = rows[1]
    assert label.startswith("order ") and label.endswith(" interleaved") and layers == 2
    assert measured == {"paged": 101.0, "cascade": 81.0} and w.num_groups == len(SHAPES[0][1])
    out = tmp_path / "model.json"
    assert cal.refit_from(str(H200), str(out), order=str(p)) == 0
    assert json.loads(out.read_text())["calibration"]["refit"]["order"] == "batch_order.json"
    with pytest.raises(ValueError, match="heads"):
        p.write_text(json.dumps(dict(run, meta={"heads": [40, 8, 128]})))
        cal.rows_from_order(str(p))
    with pytest.raises(ValueError, match="not one of"):
        p.write_text(json.dumps(dict(run, rows=[dict(run["rows"][0], shape="nope")])))
        cal.rows_from_order(str(p))
