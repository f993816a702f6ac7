"""Where a benchmark's JSON result goes: `--out -` prints it, any other value is a file path
(parent folders made; a line on stderr says where). Standalone scripts only."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_json(result: Any, out: str) -> None:
    """Write `result` as indented JSON to stdout (`out` "-") or to the file `out`."""
    text = json.dumps(result, indent=2) + "\n"
    if out == "-":
        sys.stdout.write(text)
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
