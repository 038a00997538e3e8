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
