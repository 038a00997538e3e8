"""What GraniKV needs from SGLang's server arguments, before ServerArgs is built: the config
of the ``--enable-granikv`` / ``--granikv-*`` values, the settings it sets in SGLang's own
(radix cache backend, page size, attention backend) and the SGLang version gate.

Policy only: the hooks that call these live in :mod:`granikv.plugin`.
"""

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Set

from granikv import sglang_compat as compat
from granikv.config import ENABLE_FLAG, GraniKVConfig, cli_flag, given_flags

logger = logging.getLogger("granikv")

#: The radix cache backend name GraniKV registers with SGLang.
CACHE_BACKEND_NAME = "granikv"


def config_from_flags(values: Mapping[str, Any]) -> GraniKVConfig:
    """The config of ``--enable-granikv`` / ``granikv_*`` values: validated when enabled;
    without ``--enable-granikv`` the other values are ignored (one warning names them) and the
    disabled default is returned, so an installed-but-disabled GraniKV changes nothing."""
    if not values.get(ENABLE_FLAG):
        ignored = given_flags(values)
        if ignored:
            logger.warning("GraniKV: %s ignored (GraniKV is off; add --enable-granikv)",
                           ", ".join(ignored))
        return GraniKVConfig()
    return GraniKVConfig.from_mapping(values)


def apply_to_server_kwargs(cfg: GraniKVConfig, get: Callable[[str], Any],
                            set_: Callable[[str, Any], None]) -> None:
    """Settings GraniKV needs from SGLang itself (before ServerArgs is built and sealed)."""
    if not cfg.enable:
        return
    backend = get("radix_cache_backend")
    if backend not in (None, CACHE_BACKEND_NAME):
        raise ValueError(
            f"--enable-granikv needs --radix-cache-backend={CACHE_BACKEND_NAME} (or unset), "
            f"got {backend!r}"
        )
    set_("radix_cache_backend", CACHE_BACKEND_NAME)
    page_size = get("page_size")
    if page_size not in (None, 1):
        logger.warning(
            "GraniKV: --page-size=%s overridden to 1 (the COLD pool is token-granular)", page_size
        )
    set_("page_size", 1)
    if get("disable_radix_cache"):
        raise ValueError("--enable-granikv needs the radix cache; drop --disable-radix-cache")
    choose_attention_backend(get, set_)


#: The attention backends GraniKV's shared-prefix attention has run behind on a GPU (tests,
#: correctness check, grid; fa3 on an H200, docs/results/fa3.md). Blackwell's default
#: (trtllm_mha) GraniKV wraps but has never run behind on a GPU.
VERIFIED_BACKENDS = ("flashinfer", "triton", "fa3")
#: What ``--enable-granikv`` serves on when no attention backend is given, in order of preference
#: (the first one installed). Not SGLang's Hopper default fa3: GraniKV needs page size 1, where
#: stock fa3 decoded 1.25-1.57x slower than stock flashinfer on the H200's grid rows with 10-32K
#: contexts (within 6% without a long context; docs/results/fa3.md), and every step GraniKV
#: leaves to the wrapped backend is stock.
DEFAULT_CHOICES = ("flashinfer", "triton")
_BACKEND_KEYS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def choose_attention_backend(get: Callable[[str], Any], set_: Callable[[str, Any], None]) -> None:
    """With no attention backend given, the first installed of ``DEFAULT_CHOICES`` (flashinfer,
    else triton) instead of SGLang's per-GPU default, with one log line; a given unverified one is
    kept, with one line saying so. Only on a CUDA device (SGLang's other platforms choose
    their own backend, and GraniKV's kernels need CUDA)."""
    given = {k: get(k) for k in _BACKEND_KEYS if get(k) is not None}
    if not given:
        if not _cuda_device(get("device")):
            return
        import importlib.util

        choice = next((b for b in DEFAULT_CHOICES if importlib.util.find_spec(b) is not None), DEFAULT_CHOICES[-1])
        set_("attention_backend", choice)
        logger.info("GraniKV: no --attention-backend given: serving with %s (verified behind GraniKV on a GPU: "
                    "%s) instead of SGLang's default for this GPU (fa3 on Hopper: slower than flashinfer at "
                    "the page size 1 GraniKV needs; trtllm_mha on Blackwell: not yet run behind GraniKV); "
                    "pass --attention-backend to choose", choice, ", ".join(VERIFIED_BACKENDS))
        return
    for key, value in given.items():
        if value not in VERIFIED_BACKENDS:
            logger.warning("GraniKV: --%s=%s: GraniKV wraps this backend but has not been verified behind it "
                           "on a GPU (verified: %s); its decode and prefill outputs are checked only by "
                           "--granikv-debug-compare-every", key.replace("_", "-"), value,
                           ", ".join(VERIFIED_BACKENDS))


def _cuda_device(device: Optional[str]) -> bool:
    if device is not None:
        return str(device).startswith("cuda")
    import torch

    return bool(torch.cuda.is_available())


_warned: Set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def version_gate(cfg: GraniKVConfig) -> GraniKVConfig:
    """``cfg``, or ``cfg`` turned off on an SGLang release GraniKV was not tested with (unless
    ``--granikv-allow-untested-sglang``): stock SGLang then serves, nothing GraniKV's is set."""
    version = compat.sglang_version()
    if not cfg.enable or compat.is_tested(version):
        return cfg
    tested = ", ".join(compat.SUPPORTED)
    flag = cli_flag("allow_untested_sglang")
    if cfg.allow_untested_sglang:
        _warn_once(f"GraniKV: SGLang {version} is not a tested release (tested: {tested}); "
                   f"running anyway ({flag}), as SGLang {compat.release.name}")
        return cfg
    _warn_once(f"GraniKV: SGLang {version} is not a tested release (tested: {tested}): GraniKV "
               f"is OFF and stock SGLang serves; pass {flag} to run it anyway")
    return dataclasses.replace(cfg, enable=False)
