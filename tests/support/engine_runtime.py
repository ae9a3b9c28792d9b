"""A fake API server for `continuum engine`'s process (its Engine, GrantLedger and the
status it writes)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support import fake_llama


def fake_server(tmp_path: Path) -> str:
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake_llama.__file__}" "$@"\n')
    script.chmod(0o755)
    return str(script)
