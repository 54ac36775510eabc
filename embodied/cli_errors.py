"""How every ``embodied`` command reports a user error: one line on stderr, exit code 2."""

from __future__ import annotations

import sys


def error(msg: str) -> int:
    """Print ``embodied: error: MSG`` as one line (a driver's message may span several); 2."""
    line = " ".join(part.strip() for part in str(msg).splitlines() if part.strip())
    print(f"embodied: error: {line}", file=sys.stderr)
    return 2
