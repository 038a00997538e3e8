"""sglang_compat: which release branch serves which SGLang, and what each name does on the
running release (against SGLang's real classes)."""

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from support.scheduler_sim import Sim, SimConfig

from granikv import sglang_compat as compat


@pytest.mark.parametrize("text, want", [
    ("0.5.17", (0, 5, 17)), ("0.5.23.post1", (0, 5, 23)), ("0.5.24rc1", (0, 5, 24)),
    ("1.0", (1, 0)), ("unknown", ()),
])
def test_parse_version(text, want):
    assert compat.parse_version(text) == want


@pytest.mark.parametrize("version, branch", [
    ("0.5.17", "0.5.17"), ("0.5.20", "0.5.17"), ("0.5.23", "0.5.23"), ("0.5.23.post2", "0.5.23"),
    ("0.6.0", "0.5.23"), ("0.5.10", "0.5.17"),
])
def test_newest_branch_not_newer_than_the_running_release(version, branch):
    assert compat._pick(version).name == branch


def test_tested_releases():
    assert compat.is_tested("0.5.17") and compat.is_tested("0.5.23")
    assert not compat.is_tested("0.5.20") and not compat.is_tested("0.6.0")
    assert compat.is_tested()  # the suite runs on a supported release


def test_the_running_release_picks_its_own_branch():
    import sglang

    assert compat.sglang_version() == sglang.__version__
    assert compat.release.name == sglang.__version__  # CI runs supported releases only
    assert compat.release is compat._pick(sglang.__version__)


def test_lifecycle_names_exist_on_sglangs_radix_cache():
    """The calls the mixin overrides are SGLang's own on this release (a rename upstream fails
    here, not silently in serving)."""
    calls = (("checkpoint", "on_release") if compat.LIFECYCLE == "checkpoint"
             else ("cache_unfinished_req", "cache_finished_req"))
    for name in calls:
        assert callable(getattr(RadixCache, name)), name
        assert name in vars(compat.lifecycle_mixin()), name


def test_request_state_match_results_and_remove_events_on_real_objects():
    sim = Sim(SimConfig())
    prompt = list(range(3, 40))
    req = sim.admit(prompt)
    idx = compat.req_pool_idx(req)
    assert idx is not None and 1 <= idx < sim.req_pool.req_to_token.shape[0]
    assert compat.cache_protected_len(req) == len(prompt)  # the prefill went into the tree
    assert compat.kv_allocated_len(req) == len(prompt)
    res = sim.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt))))
    assert compat.match_length(res) == len(prompt)
    row = sim.req_pool.req_to_token[idx, : len(prompt)].to(torch.int64)
    assert torch.equal(compat.match_indices(sim.cache, res), row)
    removed = []
    if compat.LIFECYCLE == "checkpoint":
        sim.cache.kv_events.record_remove = removed.append
    else:
        sim.cache._record_remove_event = removed.append
    sim.finish(req)
    sim.evict(1 << 20)
    assert removed and all(n.parent is not None for n in removed)
    assert compat.free_group_parts(sim.allocator) == []  # outside a group: [] or None
    sim.allocator.free_group_begin()
    slots = sim.allocator.alloc(3)
    sim.allocator.free(slots)
    assert torch.equal(torch.cat(compat.free_group_parts(sim.allocator)).sort().values,
                       slots.sort().values)
    sim.allocator.free_group_end()


def test_kv_slot_translation_read_from_each_releases_own_attribute():
    from types import SimpleNamespace

    old, new = compat._pick("0.5.17"), compat._pick("0.5.23")
    v0517 = SimpleNamespace(_translate_kv_loc=lambda loc: loc)
    v0523 = SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True))
    assert old.backend_translates_kv_slots(v0517) and not old.backend_translates_kv_slots(v0523)
    assert new.backend_translates_kv_slots(v0523) and not new.backend_translates_kv_slots(v0517)
    plain = SimpleNamespace(_translate_kv_loc=None,
                            kv_index_translator=SimpleNamespace(is_translating=False))
    assert not old.backend_translates_kv_slots(plain) and not new.backend_translates_kv_slots(plain)
    assert compat.KV_TRANSLATION_ATTR == compat.release.kv_translation_attr
