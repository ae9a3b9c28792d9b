"""continuum-operator: governs memory and turns for local-model serving on Kubernetes.

The package is a functional core (`model`, `core`) inside a thin shell (`kube`, `agent`,
`engine`, `cli`). See docs/design.md for the rules the core keeps.
"""

__version__ = "0.1.0"
