"""Renders the README's flag table and its example error from ``granikv.config``, or checks them.

    python scripts/flag_table.py --check    # exit 1, with a diff, if README.md's regions differ
    python scripts/flag_table.py --write    # rewrite those regions of README.md

Only the text between two pairs of marker lines in README.md is generated; the rest of the
file is left as it is:

    <!-- flags: begin -->          the table: one row per GraniKVConfig field, in field order
    <!-- flags: end -->
    <!-- flag-error: begin -->     the error an out-of-range value gives, produced by building
    <!-- flag-error: end -->       GraniKVConfig with that value and capturing the ValueError

The rows come from the same sources as the CLI: the flag names, value types and option-set
metavars from an argparse parser that :func:`granikv.config.add_cli_args` fills, and the
defaults, ranges and help texts from the fields' ``_opt(...)`` metadata. Nothing here needs
SGLang or a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "python"))

from granikv.config import GraniKVConfig, add_cli_args, attr_name, cli_flag  # noqa: E402

TABLE = "flags"
ERROR = "flag-error"
# The field whose out-of-range value the README's example error shows.
ERROR_FIELD = "hot_fraction"


def _markers(name: str) -> Tuple[str, str]:
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _actions() -> Dict[str, argparse.Action]:
    """The argparse actions the CLI adds, by dest (the same code SGLang's parser runs)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    return {a.dest: a for a in parser._actions}


def _type(action: argparse.Action, md) -> str:
    if md.get("choices") is not None:
        return ", ".join(f"`{c}`" for c in md["choices"])
    if isinstance(action, argparse._StoreTrueAction):
        return "switch"
    return (action.type or str).__name__


def _default(f: dataclasses.Field) -> str:
    if f.default is None:
        return "–"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return f"`{f.default}`"


def _range(md) -> str:
    if md.get("lo") is None:
        return "–"
    return f"[{md['lo']}, {md['hi']}]"


def render_table() -> str:
    actions = _actions()
    lines = ["| flag | type / choices | default | range | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(GraniKVConfig):
        action = actions[attr_name(f.name)]
        (flag,) = action.option_strings
        assert flag == cli_flag(f.name), (flag, f.name)
        md = f.metadata
        lines.append(f"| `{flag}` | {_type(action, md)} | {_default(f)} | {_range(md)} | "
                     f"{_cell(md['help'])} |")
    return "\n".join(lines)


def example_error() -> str:
    """The ValueError GraniKVConfig raises for a value above ERROR_FIELD's range, as the
    launcher prints it."""
    f = {f.name: f for f in dataclasses.fields(GraniKVConfig)}[ERROR_FIELD]
    value = f.metadata["hi"] * 2 if f.metadata["hi"] > 0 else f.metadata["hi"] + 1
    try:
        GraniKVConfig(**{ERROR_FIELD: value})
    except ValueError as e:
        return f"    error: {e}"
    raise AssertionError(f"GraniKVConfig accepted {ERROR_FIELD}={value!r}")


def regions() -> Dict[str, str]:
    return {TABLE: render_table(), ERROR: example_error()}


def regenerate(text: str, name: str = "README.md") -> str:
    """``text`` with every marked region replaced by what this script renders.

    Raises ValueError naming the marker when a begin or end marker is missing, doubled or out
    of order."""
    for region, body in regions().items():
        begin, end = _markers(region)
        lines = text.split("\n")
        starts = [i for i, line in enumerate(lines) if line.strip() == begin]
        ends = [i for i, line in enumerate(lines) if line.strip() == end]
        for marker, found in ((begin, starts), (end, ends)):
            if len(found) != 1:
                raise ValueError(f"{name}: expected one line {marker!r}, found {len(found)}")
        if ends[0] < starts[0]:
            raise ValueError(f"{name}: {end!r} comes before {begin!r}")
        lines[starts[0] + 1:ends[0]] = body.split("\n")
        text = "\n".join(lines)
    return text


def diff(old: str, new: str, name: str = "README.md") -> List[str]:
    return list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{name} (checked in)",
                                     f"{name} (generated)", lineterm=""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff if README differs")
    mode.add_argument("--write", action="store_true", help="rewrite README.md's marked regions")
    p.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    old = args.readme.read_text()
    try:
        new = regenerate(old, args.readme.name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.write:
        if new != old:
            args.readme.write_text(new)
        print(f"{args.readme.name}: {'rewritten' if new != old else 'unchanged'}")
        return 0
    if new != old:
        print("\n".join(diff(old, new, args.readme.name)))
        print(f"{args.readme.name} differs from granikv.config: run "
              "`python scripts/flag_table.py --write`", file=sys.stderr)
        return 1
    print(f"{args.readme.name}: flag table up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
