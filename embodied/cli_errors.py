"""How every ``embodied`` command reports a user error: one line on stderr, exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path


def error(msg: str) -> int:
    """Print ``embodied: error: MSG`` as one line (a driver's message may span several); 2."""
    line = " ".join(part.strip() for part in str(msg).splitlines() if part.strip())
    print(f"embodied: error: {line}", file=sys.stderr)
    return 2


def file_in_the_way(path: str | Path) -> str | None:
    """Why ``path`` cannot be a directory to write in ("is a file", "is inside F, a file": it, or
    the nearest of its parents that exists, is a file or a broken link); None when it can be."""
    path = Path(path)
    try:
        # (a root, at worst)
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if existing.is_dir():
            return None
    except OSError as e:
        return f"cannot be reached ({e.strerror or e})"
    what = "a file" if existing.exists() else "a broken link"
    return f"is {what}" if existing == path else f"is inside {existing}, {what}"
