"""Every GraniKV backend wrapped for a model runner, so the scheduler can stage all of them.

SGLang may build several full-attention backends for one model runner and compose them:
``HybridAttnBackend`` (``--prefill-attention-backend`` != ``--decode-attention-backend``), two-batch
overlap (``TboAttnBackend``: a primary and two children), pdmux (one per SM group). Each is built
by ``_build_full_attention_backend_from_str``, which plugin.py wraps; the wrapper registers the
instance here. The list lives on the model runner (``_granikv_backends``), not in a global, and
is in wrap order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

    from granikv.attention.backend import GraniKVAttnBackend
    from granikv.attention.dispatcher import Dispatcher

_ATTR = "_granikv_backends"


def register(model_runner: ModelRunner, backend: GraniKVAttnBackend) -> None:
    """Records ``backend`` as wrapped for ``model_runner`` (once per instance)."""
    backends = model_runner.__dict__.setdefault(_ATTR, [])
    if all(b is not backend for b in backends):
        backends.append(backend)


def backends_of(model_runner: Optional[ModelRunner]) -> List[GraniKVAttnBackend]:
    """The GraniKV backends wrapped for ``model_runner``, in wrap order ([] if none)."""
    if model_runner is None:
        return []
    return list(getattr(model_runner, "__dict__", {}).get(_ATTR, ()))


def dispatcher_of(model_runner: Optional[ModelRunner]) -> Optional[Dispatcher]:
    """The dispatcher (cost model and head shapes) of the first GraniKV backend wrapped for
    ``model_runner``, which the pays_off promotion policy prices promotions with (None: no
    GraniKV attention on that runner)."""
    backends = backends_of(model_runner)
    return backends[0].dispatcher if backends else None
