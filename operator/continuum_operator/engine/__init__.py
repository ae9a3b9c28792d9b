"""The engine runtime: llama-server behind the grant gateway (docs/gateway.md).

- `admission`: what the gateway decides (admission, token caps, table changes); pure.
- `gateway`: the aiohttp gateway in front of llama-server that enforces the grant table.
- `grants_source`: the grant table from a file or the Engine's GrantLedger; the
  `status.runtime` writer.
- `runtime`: `continuum engine`, llama-server kept running, its load receipted.
- `metrics`: the runtime's Prometheus metrics.
- `receipts`: receipt files and receipts from captured logs.
- `turn`: the client side, how a mind takes a turn.
"""
