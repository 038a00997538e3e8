"""The prefix launch's wave target per step shape (attention/decode/launch_table.py).

The table's rules and their lookup; the workspace's capacity covering the widest target; a step
whose rule asks for more waves planned with more prefix items (and one with no rule planned as
without a table), its cascade output still matching the float64 reference in the interpreter.
Planted fault: a workspace sized for the config's waves only cannot take the table's step.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from granikv.attention.decode import launch_table as lt
from granikv.attention.decode.launch_table import LaunchTable, rules_of
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.cascade import cascade_attention
from granikv.kernels.plan import Grouping
from granikv.kernels.reference import decode_attention_ref

TABLE = LaunchTable(rules_of([(64, 64, 4096, 1024, 1.25), (64, 16, 128, 1024, 3.0), (128, 64, 128, 1024, 2.0),
                               (64, 16, 65536, 1024, 0.75), (64, 16, 128, 64, 1.0)]))


def test_rules_sorted_and_looked_up_in_order():
    assert [(r.max_rows, r.max_prefix, r.max_suffix) for r in TABLE.rules if r.head_dim == 64] == [
        (16, 128, 64), (16, 128, 1024), (16, 65536, 1024), (64, 4096, 1024)]
    assert TABLE.waves_for(64, 12, 100, 64) == 1.0  # the tightest rule first
    assert TABLE.waves_for(64, 12, 100, 65) == 3.0  # a longer suffix: the next rule
    assert TABLE.waves_for(64, 16, 129, 10) == 0.75
    assert TABLE.waves_for(64, 17, 4096, 1024) == 1.25
    assert TABLE.waves_for(64, 17, 4096, 1025) is None  # past every rule's suffix
    assert TABLE.waves_for(64, 65, 10, 10) is None  # no rule: the config's waves
    assert TABLE.waves_for(128, 64, 128, 5) == 2.0 and TABLE.waves_for(128, 64, 129, 5) is None
    assert TABLE.max_prefix_waves == 3.0 and LaunchTable(()).max_prefix_waves == 0.0


def test_dominant_group_is_the_most_work_and_the_suffix_the_batch_mean():
    # group 0: 2 members x 100 tokens; group 1: 3 members x 30 tokens -> group 0 (200 > 90)
    g = Grouping.of([1, 200], [100, 30], [0, 2, 5], [0, 1, 2, 3, 4], [100, 100, 30, 30, 30, 0])
    seq = np.array([110, 120, 40, 50, 60, 60])  # suffixes 10, 20, 10, 20, 30, 60: mean 25
    table = LaunchTable(rules_of([(64, 8, 100, 25, 2.5), (64, 8, 100, 1000, 1.25), (64, 12, 30, 1000, 1.0)]))
    assert table.waves_for_step(g, seq, ratio=4, head_dim=64) == 2.5  # 2 members x ratio 4 = 8 rows
    assert table.waves_for_step(g, seq + 1, ratio=4, head_dim=64) == 1.25  # mean suffix 26
    assert table.waves_for_step(Grouping.empty(3), np.ones(3), ratio=4, head_dim=64) is None


def test_json_round_trip_and_refusals(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(TABLE.to_mapping(), gpu="X")))
    loaded = LaunchTable.load(str(path))
    assert loaded.rules == TABLE.rules and loaded.gpu == "X" and loaded.source == str(path)
    with pytest.raises(ValueError, match="outside the allowed ranges"):
        LaunchTable(rules_of([(64, 8, 100, 64, 9.0)]))
    path.write_text(json.dumps({"rules": [{"head_dim": 64}]}))
    with pytest.raises(ValueError, match="malformed"):
        LaunchTable.load(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        LaunchTable.load(str(path))
    monkeypatch.setattr(lt, "DATA_DIR", str(tmp_path))
    assert LaunchTable.for_gpu("NVIDIA Nothing") is None and LaunchTable.for_gpu(None) is None
    (tmp_path / "launch_table_nvidia-h200.json").write_text(json.dumps(TABLE.to_mapping()))
    assert LaunchTable.for_gpu("NVIDIA H200").rules == TABLE.rules


def _batch():
    # one dominant group of 5 members (ratio 4: 20 rows per kv head) over 600 tokens, a small one, 2 ungrouped
    return make_batch(groups=((600, 5), (40, 2)), n_ungrouped=2, suffix=17, num_q_heads=8, num_kv_heads=2,
                      head_dim=64, dtype=torch.float32, seed=11)


CFG = dataclasses.replace(SMALL_CONFIG, prefix_waves=1.0)


def _workspace(b, table):
    return CascadeWorkspace(b.bs + 2, 8, 2, 64, "cpu", config=CFG, sm_count=32, max_splits=64, launch_table=table)


def test_a_rule_changes_the_steps_prefix_items_and_the_output_stays_exact():
    b = _batch()
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    items = {}
    for name, table in (("none", None), ("miss", LaunchTable(rules_of([(64, 4, 600, 1000, 3.0)]))),
                        ("short", LaunchTable(rules_of([(64, 20, 600, 5, 3.0)]))),  # suffixes are longer
                        ("wide", LaunchTable(rules_of([(64, 20, 600, 1000, 3.0)])))):
        ws = _workspace(b, table)
        wl = fill(ws, b)
        ws.check_integrity()
        items[name] = wl.num_prefix_items
        out = cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert items["miss"] == items["none"] == items["short"]  # 20 rows > 4 / suffixes > 5: the config's waves
    assert items["wide"] > items["none"]  # 3 waves instead of 1: more, shorter chunks


def test_capacity_covers_the_widest_rule_and_without_it_the_step_does_not_fit(monkeypatch):
    b = _batch()
    wide = LaunchTable(rules_of([(64, 20, 600, 1000, 3.0)]))
    assert _workspace(b, wide).prefix_cap > _workspace(b, None).prefix_cap
    # planted fault: the table given to the step but not to the capacity
    ws = _workspace(b, None)
    ws.launch_table = wide
    with pytest.raises(ValueError, match="exceeds the workspace"):
        fill(ws, b)
    assert np.all(np.asarray(ws.counters) == 0)
