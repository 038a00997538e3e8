"""GraniKV: shared-prefix KV storage and attention for multi-agent serving, as an SGLang plugin."""

__version__ = "0.1.0"
