"""`continuum model tiny PATH`: a tiny random-weight GGUF to try the example Engines with.

No model is ever downloaded here; a newcomer still needs a file llama.cpp loads to see an Engine
serve. This writes `testing.tiny_gguf`'s llama model (the same shape and seed give the same
bytes, so the examples in `examples/engines/` can name its sha256) and prints its path, size and
sha256, with where the examples expect it. Its text is noise: it is for trying the plumbing,
not for answers. Exit codes as in `cli`: 0 written, 2 a path that cannot be written.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail
from continuum_operator.testing.tiny_gguf import TinyModelShape, write_tiny_gguf

__all__ = ["TINY_SHAPE", "add_arguments", "cmd_model_tiny", "sha256_of"]


#: The shape `continuum model tiny` writes: 4 layers, 2,048 tokens of context, about 1.4 MiB.
TINY_SHAPE = TinyModelShape()
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def cmd_model_tiny(args: argparse.Namespace) -> int:
    path: Path = args.path
    if path.is_dir():
        return fail(
            f"{path} is a directory; give the file to write, e.g. {path / 'tiny.gguf'}",
            EXIT_INVALID,
        )
    if path.exists() and not args.force:
        return fail(f"{path} exists; pass --force to overwrite it", EXIT_INVALID)
    try:
        write_tiny_gguf(path, TINY_SHAPE, seed=args.seed)
    except OSError as err:
        return fail(f"{path}: cannot write it: {err.strerror or err}", EXIT_INVALID)
    size = path.stat().st_size
    print(f"path:   {path.resolve()}")
    print(f"size:   {size} bytes ({size / 2**20:.1f} MiB)")
    print(f"sha256: {sha256_of(path)}")
    print(
        f"A random-weight llama model ({TINY_SHAPE.n_layer} layers, "
        f"{TINY_SHAPE.context_length} tokens of context): llama.cpp loads and serves it, and "
        "its text is noise.\n"
        "examples/engines/with-source/tiny-chat.yaml reads it at "
        "/var/lib/continuum/models/tiny.gguf on the node,\n"
        "examples/engines/with-source/tiny-chat-pvc.yaml as tiny.gguf in the "
        "PersistentVolumeClaim continuum-models;\nboth name the sha256 of seed 0. "
        "`continuum facts PATH` prints its facts."
    )
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommands of `continuum model` (cli.py declares the command): `model tiny`."""
    models = p.add_subparsers(dest="model_command", required=True, metavar="KIND")
    tiny = models.add_parser(
        "tiny",
        help="write a tiny random-weight GGUF (about 1.4 MiB)",
        description="Write a tiny random-weight llama GGUF that llama.cpp loads (its text is "
        "noise) and print its path, size and sha256. The same seed gives the same bytes.",
    )
    tiny.add_argument("path", type=Path, metavar="PATH", help="the file to write")
    tiny.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    tiny.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    tiny.set_defaults(func=cmd_model_tiny)
