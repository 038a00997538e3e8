"""Tests publish a private ``ServerArgs`` in SGLang's process-wide runtime context and put the
enclosing one back afterwards (a real backend's constructor reads its configuration there).

The two supported releases save and restore that context differently: 0.5.17 has
``RuntimeContext.preserve_config()``; 0.5.23 dropped it for ``snapshot_context()`` /
``restore_context()``. Test support only: GraniKV itself never publishes a ``ServerArgs``.
"""

from contextlib import contextmanager


@contextmanager
def published_server_args(server_args):
    """``server_args`` is the process's published configuration inside the block."""
    from sglang.srt import runtime_context as rc

    ctx = rc.get_context()
    if hasattr(ctx, "preserve_config"):  # 0.5.17
        with ctx.preserve_config():
            ctx.set_server_args(server_args)
            yield
        return
    saved = rc.snapshot_context()  # 0.5.23
    try:
        ctx.set_server_args(server_args)
        yield
    finally:
        rc.restore_context(saved)


def add_newer_runner_fields(runner, device: str = "cpu") -> None:
    """What 0.5.23's attention backends read from a (stand-in) model runner beyond 0.5.17's
    fields: the runner's ``KVIndexTranslator`` (the real one, built as ``ModelRunner`` builds it;
    a plain pool translates nothing) and ``decode_num_tokens_per_req`` (the real method, no
    speculation). Nothing on 0.5.17."""
    try:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    except ImportError:  # 0.5.17
        return
    from types import MethodType

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner.kv_index_translator = KVIndexTranslator(
        req_to_token=runner.req_to_token_pool.req_to_token,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        token_to_kv_pool=runner.token_to_kv_pool, page_size=1, device=device)
    assert not runner.kv_index_translator.is_translating
    runner.spec_algorithm = SpeculativeAlgorithm.NONE
    runner.decode_num_tokens_per_req = MethodType(ModelRunner.decode_num_tokens_per_req, runner)


def bind_kv_loc_plan(runner, fb) -> None:
    """0.5.23: a forward batch carries its KV location plan (as ``ForwardBatch`` binds it);
    nothing on 0.5.17 (no translator on the runner)."""
    translator = getattr(runner, "kv_index_translator", None)
    if translator is not None:
        translator.own_plan(fb).bind(fb, translator)
