"""How a `continuum` subcommand stops on an error: `error: WHAT` on stderr, and its exit code.

Every subcommand words its errors the same way, so a script or a person reading stderr finds
the one line that says what is wrong; the codes are each command's (cli.py states the rule).
"""

from __future__ import annotations

import sys

__all__ = ["fail"]


def fail(message: str, code: int) -> int:
    """Print `error: message` on stderr and return `code`, for `return fail(...)`."""
    print(f"error: {message}", file=sys.stderr)
    return code
