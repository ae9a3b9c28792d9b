"""The node agent: probes (NVML, psutil and cgroups, sysctl on macOS) and the NodeBoard writer.

The shell around core/nodeboard.py and core/board_change.py: `probe` gathers the raw answers of
every backend, the core turns them into a board and decides whether it changed enough to write,
`writer` sends it and renews the node's Lease, `run` loops, `cli` registers `continuum agent`.
"""
