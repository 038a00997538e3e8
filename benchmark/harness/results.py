"""Result files: JSON written atomically, markdown, an optional matplotlib figure."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional


def write_json(path: Path, doc: Any) -> Path:
    """``doc`` as indented JSON, through a temporary file renamed over ``path``: a process
    killed mid-write leaves the previous complete file, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def pyplot(quiet: bool = False, what: str = "the plot") -> Optional[Any]:
    """matplotlib.pyplot on the Agg backend, or None (with a note unless quiet) when
    matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not quiet:
            print(f"matplotlib not importable: skipping {what} (re-run the report where it is)")
        return None
    return plt
