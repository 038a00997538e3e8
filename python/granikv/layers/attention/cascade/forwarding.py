"""``ForwardingBackend``: an ``AttentionBackend`` that hands the wrapped backend everything it
does not define itself.

Three channels, all set up here and nowhere else:

- ``__getattr__``: attributes not found on the wrapper (the wrapped backend's own fields and
  methods) are read from ``inner``;
- methods and properties defined on SGLang's ``AttentionBackend`` (breakable prefill CUDA
  graphs, chunked-prefix MHA, verify buffers, ...) would shadow ``__getattr__``: each one a
  subclass does not define is forwarded to ``inner`` explicitly when the subclass is created;
- class-level flags of ``AttentionBackend`` (``FORWARDED_FLAGS``) are copied from the wrapped
  backend at construction.

``forward`` dispatches to the subclass's ``forward_decode`` / ``forward_extend``: never forwarded.
"""

try:  # SGLang is the host; GraniKV's kernels and planner do not need it.
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # pragma: no cover
    AttentionBackend = object

__all__ = ["AttentionBackend", "FORWARDED_FLAGS", "ForwardingBackend"]

# Class-level flags of AttentionBackend that __getattr__ would not forward (they exist on the
# base class), copied from the wrapped backend at construction.
FORWARDED_FLAGS = (
    "needs_cpu_seq_lens",
    "supports_ragged_verify_graph",
    "use_captured_forward_metadata_for_breakable_cuda_graph",
    "supports_full_cuda_graph_chunked_prefix",
    "prefill_attention_backend_str",
    "decode_attention_backend_str",
)
_NOT_FORWARDED = ("forward",) + FORWARDED_FLAGS


class ForwardingBackend(AttentionBackend):
    """Base of a backend wrapping ``inner``; subclasses define what they serve themselves."""

    def __init__(self, inner):
        self.inner = inner
        for name in FORWARDED_FLAGS:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _forward_base_methods(cls)

    def __getattr__(self, name):
        # Only called for attributes not found normally: delegate to the wrapped backend.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def forward_metadata(self):
        return self.inner.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value):  # SGLang resets it on idle batches
        self.inner.forward_metadata = value


def _defined_below_base(cls, name: str) -> bool:
    """``name`` is defined by ``cls`` or a class between it and ``AttentionBackend``."""
    return any(name in vars(k) for k in cls.__mro__ if issubclass(k, ForwardingBackend))


def _forward_base_methods(cls) -> None:
    """Forwards to ``inner`` each method and property of ``AttentionBackend`` that ``cls``
    (or ``ForwardingBackend``) does not define."""
    if AttentionBackend is object:  # pragma: no cover
        return
    for name, attr in vars(AttentionBackend).items():
        if name.startswith("__") or name in _NOT_FORWARDED or _defined_below_base(cls, name):
            continue
        if isinstance(attr, property):
            setattr(cls, name, property(lambda self, n=name: getattr(self.inner, n)))
        elif callable(attr):
            setattr(cls, name, lambda self, *a, n=name, **kw: getattr(self.inner, n)(*a, **kw))
