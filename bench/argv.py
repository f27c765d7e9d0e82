"""What the bench scripts share on the command line: a script's argv handed to a child without its flags,
and the JSON report each writes where --out says."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_report(out: str | Path, report: dict[str, Any]) -> None:
    """The report as indented JSON at `out` (folders made), and a line saying where."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def without(argv: list[str], flags: dict[str, int]) -> list[str]:
    """argv without `flags` (flag -> how many values follow it) in either `--flag v` or `--flag=v` form."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in flags:
            skip = 0 if "=" in arg else flags[arg]
        else:
            out.append(arg)
    return out


def engine_config(args: Any, prog: str) -> Any | None:
    """The [engine] config the parsed engine flags describe, or None after one line naming the bad key."""
    from mixserve.config import ConfigError, config_from_args

    try:
        return config_from_args(args).engine
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
