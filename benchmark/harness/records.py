"""Merging the tagged records (``row`` / ``info`` / ``error``, engine_proc) of several runs of one
benchmark, and the commands those runs were made with."""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Sequence

Key = Callable[[Mapping[str, Any]], Hashable]


def merge_records(record_lists: Iterable[Sequence[Mapping[str, Any]]], *, row_key: Key,
                  info_key: Key) -> List[Dict[str, Any]]:
    """Concatenation of the lists, in order; a later row with the same ``row_key`` replaces the
    earlier one (and moves to the later place), likewise an info with the same ``info_key``;
    every error (any other kind) is kept."""
    out: Dict[Hashable, Dict[str, Any]] = {}
    n_errors = 0
    for records in record_lists:
        for r in records:
            kind = r.get("kind")
            if kind == "row":
                k: Hashable = ("row", row_key(r))
            elif kind == "info":
                k = ("info", info_key(r))
            else:
                n_errors += 1
                k = ("error", n_errors)
            out.pop(k, None)
            out[k] = dict(r)
    return list(out.values())


def commands_of(metas: Sequence[Mapping[str, Any]]) -> List[str]:
    """Every command of the runs' metas (``commands`` or ``command``), first occurrence kept."""
    return list(dict.fromkeys(c for m in metas for c in (m.get("commands") or [m.get("command")]) if c))
