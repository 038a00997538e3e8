"""What GraniKV relies on in the installed SGLang, checked so that an upgrade or a rename fails a
test instead of silently turning a GraniKV path off: every hook target resolves (SGLang's
``apply_hooks`` only logs a failure), and every attribute GraniKV reads from SGLang objects
through ``getattr(..., default)`` exists on the real class or instance."""

import ast
import dataclasses
import inspect
import pkgutil
import textwrap

import pytest
import torch

from granikv import plugin, sglang_compat as compat


def _assigned_self_attrs(cls) -> set:
    """Names ``X`` of every ``self.X = ...`` (or ``self.X: T = ...``) in ``cls``'s own source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    out.add(sub.attr)
    return out


@pytest.mark.parametrize("key", sorted(plugin._TARGETS))
def test_every_hook_target_resolves(key):
    obj_path, attr = plugin._TARGETS[key].rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    assert hasattr(obj, attr), f"{plugin._TARGETS[key]} is gone: the {key} hook would not apply"


def test_hooked_signatures_match_the_hooks():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup as setup

    params = inspect.signature(setup._build_full_attention_backend_from_str).parameters
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == {
        "model_runner", "backend_str", "init_new_workspace"}
    assert list(inspect.signature(KVCacheConfigurator._profile_available_bytes).parameters) == [
        "self", "pre_model_load_memory"]
    fields = {f.name for f in dataclasses.fields(KVCacheConfigurator)}
    assert {"server_args", "is_draft_worker", "device", "gpu_id", "model"} <= fields


def test_flashinfer_attributes_read_with_defaults_exist():
    from sglang.srt.layers.attention import flashinfer_backend as fi

    fields = {f.name for f in dataclasses.fields(fi.PrefillMetadata)}
    # ExtendPaths.plan: use_ragged -> False or extend_no_prefix -> True would turn the HOT
    # prefill path off without an error
    assert {"prefill_wrappers", "use_ragged", "extend_no_prefix", "multi_item_params"} <= fields
    assert {"workspace_buffer", "prefill_uses_dequant_workspace", "forward_metadata"} <= _assigned_self_attrs(
        fi.FlashInferAttnBackend)


def test_triton_attributes_read_with_defaults_exist():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    # full_extend.backend_reason: a missing name would read as "no translation" / "not
    # deterministic" and let GraniKV's extend kernel read slot ids it cannot interpret
    assert {"enable_deterministic", "dcp_size", compat.KV_TRANSLATION_ATTR,
            "forward_metadata"} <= _assigned_self_attrs(TritonAttnBackend)


def test_model_runner_and_pool_attributes_exist():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.model_runner import ModelRunner

    assert {"use_mla_backend", "sliding_window_size", "kv_cache_dtype", "model",
            "token_to_kv_pool_allocator"} <= _assigned_self_attrs(ModelRunner)
    pool = MHATokenToKVPool(8, page_size=1, dtype=torch.float16, head_num=2, head_dim=64, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    for name in ("set_kv_buffer", "get_key_buffer", "get_value_buffer", "store_dtype", "dtype",
                 "is_quantized_kv_cache"):
        assert hasattr(pool, name), name


def test_war_barrier_names_are_the_running_releases():
    """war_barrier.drop_early_read_done reads the worker's runner and its event by the names
    sglang_compat gives: a rename would leave SGLang's early read-done event in place."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner import ModelRunner

    assert isinstance(inspect.getattr_static(TpModelWorker, compat.WAR_RUNNER_ATTR), property)
    assert compat.WAR_EVENT_ATTR in _assigned_self_attrs(ModelRunner)
    barrier = inspect.getsource(Scheduler._apply_war_barrier)
    assert f"model_worker.{compat.WAR_RUNNER_ATTR}" in barrier
    assert f"runner.{compat.WAR_EVENT_ATTR}" in barrier


def test_radix_attention_has_every_attribute_layer_reason_reads():
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(num_heads=8, head_dim=64, scaling=0.125, num_kv_heads=2, layer_id=0)
    for name in ("layer_id", "scaling", "head_dim", "qk_head_dim", "v_head_dim", "tp_q_head_num",
                 "tp_k_head_num", "is_cross_attention", "attn_type", "sliding_window_size", "logit_cap",
                 "xai_temperature_len", "use_irope", "pos_encoding_mode", "k_scale", "v_scale",
                 "k_scale_float", "v_scale_float"):
        assert hasattr(layer, name), name


def test_the_attribute_scan_fails_on_a_rename():
    class Renamed:
        def __init__(self):
            self.use_ragged_v2 = True

    assert "use_ragged" not in _assigned_self_attrs(Renamed)  # what a rename upstream looks like
