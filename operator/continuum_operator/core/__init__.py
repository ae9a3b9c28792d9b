"""The pure core: boards and pools, the ledger of leases, serving plans.

Nothing here imports kopf, kubernetes, pynvml, psutil or prometheus_client (import-linter checks
it), reads the clock, or does I/O: values in, typed values with reasons out.
"""
