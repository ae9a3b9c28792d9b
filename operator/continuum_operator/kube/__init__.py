"""The operator's shell: what talks to the API server, in rooms by job (docs/architecture.md).

From the top: `process` wires everything (`continuum operator`); the loops `engines`, `grants`,
`lanes`, `nodes` and the `children`'s webhook, none importing another; `state`, what they all
read and talk through; `ledger` and `workloads`, the grant ledger and the objects built from
plans; `base`, what every loop stands on; `client`, the API server's adapters. The order is an
import-linter contract (pyproject.toml). The decisions the shell applies come from the pure core
(`continuum_operator.core`).
"""
