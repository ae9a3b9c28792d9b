"""Test helpers shipped with the package: tiny generated models for the real llama.cpp.

Nothing here is used by the operator at run time; tests, benches and demos import it to get real
GGUF files of any shape without downloading a model.
"""

from continuum_operator.testing.tiny_gguf import TinyModelShape, write_tiny_gguf

__all__ = ["TinyModelShape", "write_tiny_gguf"]
