from prometheus_client import CollectorRegistry, generate_latest

from granikv.prometheus import PrometheusExporter


def test_exporter_publishes_storage_and_attention_gauges():
    reg = CollectorRegistry()
    exp = PrometheusExporter({"tp_rank": "0"}, registry=reg)
    exp.update({"hot_used_tokens": 16384, "promotions": 2, "extended_in_place": 1, "bytes_copied": 4096,
                "attention": {"steps_per_path": {"cascade": 250, "paged": 6},
                              "hot_hit_rate": 0.75, "plan_us_mean": 42.5,
                              "work_list_builds": 3, "work_list_reuses": 97,
                              "extend_batches": 14, "extend_hot_batches": 9, "extend_exact_batches": 2,
                              "per_layer_calls": {"granikv": 12, "stock": 12}}})
    text = generate_latest(reg).decode()
    assert 'granikv:hot_used_tokens{tp_rank="0"} 16384.0' in text
    assert 'granikv:promotions_total{tp_rank="0"} 2.0' in text
    assert 'granikv:extended_in_place_total{tp_rank="0"} 1.0' in text
    assert 'granikv:decode_steps_total{path="cascade",tp_rank="0"} 250.0' in text
    assert 'granikv:hot_hit_rate{tp_rank="0"} 0.75' in text
    assert 'granikv:plan_us_mean{tp_rank="0"} 42.5' in text
    assert 'granikv:work_list_fills_total{kind="reused",tp_rank="0"} 97.0' in text
    assert 'granikv:extend_batches_total{path="hot",tp_rank="0"} 9.0' in text
    assert 'granikv:extend_batches_total{path="exact",tp_rank="0"} 2.0' in text
    assert 'granikv:extend_batches_total{path="stock",tp_rank="0"} 3.0' in text
    assert 'granikv:decode_layer_calls_total{path="stock",tp_rank="0"} 12.0' in text


def test_exporter_publishes_unplanned_steps_fallbacks_and_backends():
    reg = CollectorRegistry()
    exp = PrometheusExporter({"tp_rank": "1"}, registry=reg)
    exp.update({"hot_used_tokens": 0})  # no GraniKV attention reachable
    assert 'granikv:attention_backends{tp_rank="1"} 0.0' in generate_latest(reg).decode()
    exp.update({"attention": {"unplanned_steps": 7, "backends": 2,
                              "extend_fallbacks": {"batch not staged": 3, "no HOT prefix in the batch": 5},
                              "decode_paged_reasons": {"no cascade graph of this batch size": 4}}})
    text = generate_latest(reg).decode()
    assert 'granikv:unplanned_steps_total{tp_rank="1"} 7.0' in text
    assert 'granikv:extend_fallbacks_total{reason="batch not staged",tp_rank="1"} 3.0' in text
    assert 'granikv:extend_fallbacks_total{reason="no HOT prefix in the batch",tp_rank="1"} 5.0' in text
    assert 'granikv:decode_paged_reasons_total{reason="no cascade graph of this batch size",tp_rank="1"} 4.0' in text
    assert 'granikv:attention_backends{tp_rank="1"} 2.0' in text


def test_exporter_publishes_plan_sections_and_a_cumulative_histogram():
    reg = CollectorRegistry()
    exp = PrometheusExporter({"tp_rank": "0"}, registry=reg)
    exp.update({"attention": {"planned_steps": 10, "plan_cpu_us_total": 150.0,
                              "plan_sections_us_total": {"lookup": 40.0, "upload": 90.0},
                              "plan_us_hist": {"16": 3, "22.63": 5, "inf": 2}}})
    text = generate_latest(reg).decode()
    assert 'granikv:planned_steps_total{tp_rank="0"} 10.0' in text
    assert 'granikv:plan_section_us_total{section="upload",tp_rank="0"} 90.0' in text
    assert 'granikv:plan_section_us_total{section="cpu",tp_rank="0"} 150.0' in text
    assert 'granikv:plan_us_bucket{le="16",tp_rank="0"} 3.0' in text
    assert 'granikv:plan_us_bucket{le="22.63",tp_rank="0"} 8.0' in text  # cumulative, Prometheus' way
    assert 'granikv:plan_us_bucket{le="+Inf",tp_rank="0"} 10.0' in text
    exp.update({"attention": {"plan_us_hist": {"2": 1, "16": 4, "22.63": 5, "inf": 2}}})
    text = generate_latest(reg).decode()
    assert 'granikv:plan_us_bucket{le="2",tp_rank="0"} 1.0' in text
    assert 'granikv:plan_us_bucket{le="16",tp_rank="0"} 5.0' in text
    assert 'granikv:plan_us_bucket{le="+Inf",tp_rank="0"} 12.0' in text
