"""``ForwardingBackend``: an ``AttentionBackend`` that hands the wrapped backend everything it
does not define itself.

Two channels, both set up here and nowhere else:

- ``__getattr__``: attributes not found on the wrapper (the wrapped backend's own fields and
  methods) are read from ``inner``;
- every name SGLang's ``AttentionBackend`` defines itself (methods, properties, class-level
  flags such as triton's ``supports_prefill_cuda_graph_max_context_size``, breakable prefill
  CUDA graphs, chunked-prefix MHA, verify buffers, ...) would shadow ``__getattr__`` with the
  base's default: each one a subclass does not define is forwarded to ``inner`` when the
  subclass is created. Methods are called on ``inner``; flags and properties are read from and
  written to it (a flag the wrapped backend lacks reads as the base's default). The names come
  from the base class's own namespace, not a hand list, so a release's additions are forwarded
  as they come.

``forward`` dispatches to the subclass's ``forward_decode`` / ``forward_extend``: never forwarded.
"""

from typing import Any, Callable, List, Tuple, Type, Union

try:  # SGLang is the host; GraniKV's kernels and planner do not need it.
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # pragma: no cover
    AttentionBackend = object

__all__ = ["AttentionBackend", "ForwardingBackend", "forwarded_base_names"]

_NOT_FORWARDED = ("forward", "_abc_impl")


class _ForwardedProperty(property):
    """A property this module installed (as opposed to one a subclass defines itself)."""


class ForwardingBackend(AttentionBackend):
    """Base of a backend wrapping ``inner``; subclasses define what they serve themselves."""

    forwarded_base_names: Tuple[str, ...] = ()

    def __init__(self, inner: AttentionBackend):
        self.inner = inner

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _forward_base_methods(cls)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: delegate to the wrapped backend.
        if name in ("inner", "ctx"):  # not set yet (an object being built): no forwarding
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def forward_metadata(self) -> Any:
        return self.inner.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value: Any) -> None:  # SGLang resets it on idle batches
        self.inner.forward_metadata = value


def _is_forwarded(attr: object) -> bool:
    return isinstance(attr, _ForwardedProperty) or getattr(attr, "_granikv_forwarded", False)


def _defined_below_base(cls: type, name: str) -> bool:
    """``name`` is defined by ``cls`` or a class between it and ``AttentionBackend`` (and not
    merely forwarded there by this module)."""
    return any(name in vars(k) and not _is_forwarded(vars(k)[name])
               for k in cls.__mro__ if issubclass(k, ForwardingBackend))


def forwarded_base_names(cls: type) -> List[str]:
    """What ``cls`` forwards: every name SGLang's ``AttentionBackend`` defines itself that
    ``cls`` (or a class between it and the base) does not."""
    if AttentionBackend is object:  # pragma: no cover
        return []
    return [n for n in vars(AttentionBackend)
            if not n.startswith("__") and n not in _NOT_FORWARDED and not _defined_below_base(cls, n)]


def _forwarder(name: str, attr: object) -> Union[property, Callable[..., Any]]:
    if isinstance(attr, property):
        return _ForwardedProperty(lambda self: getattr(self.inner, name),
                                  lambda self, v: setattr(self.inner, name, v))
    if not callable(attr):  # a class-level flag: the base's default if the inner lacks it
        return _ForwardedProperty(lambda self: getattr(self.inner, name, attr),
                                  lambda self, v: setattr(self.inner, name, v))
    fn = lambda self, *a, **kw: getattr(self.inner, name)(*a, **kw)  # noqa: E731
    fn._granikv_forwarded = True  # type: ignore[attr-defined]  # marks a function this module installed
    return fn


def _forward_base_methods(cls: Type[ForwardingBackend]) -> None:
    """Installs on ``cls`` a forwarder for each name of ``forwarded_base_names(cls)``."""
    cls.forwarded_base_names = tuple(forwarded_base_names(cls))
    for name in cls.forwarded_base_names:
        if not _is_forwarded(getattr(cls, name, None)):  # not inherited from a forwarding parent
            setattr(cls, name, _forwarder(name, vars(AttentionBackend)[name]))
