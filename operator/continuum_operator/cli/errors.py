"""How a `continuum` subcommand stops on an error: `error: WHAT` on stderr, and its exit code.

Every subcommand words its errors the same way, so a script or a person reading stderr finds
the one line that says what is wrong. The codes follow one rule across subcommands: 0 done,
2 invalid input (a message naming the file, the field path and what is wrong), 3 a valid request
that cannot be satisfied.
"""

from __future__ import annotations

import sys

__all__ = ["EXIT_INVALID", "EXIT_OK", "EXIT_UNSCHEDULABLE", "fail"]

EXIT_OK = 0
EXIT_INVALID = 2
EXIT_UNSCHEDULABLE = 3


def fail(message: str, code: int) -> int:
    """Print `error: message` on stderr and return `code`, for `return fail(...)`."""
    print(f"error: {message}", file=sys.stderr)
    return code
