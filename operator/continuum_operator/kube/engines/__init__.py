"""The Engines' reconciler: one pass over one Engine from the snapshot to its writes
(`reconcile`, `engine_pass`), an Engine already placed kept, confirmed or re-planned (`placed`),
its facts Job read (`facts_read`), the engine runtime's report read (`runtime_report`), the pool
gauges, and the loop on the kernel that applies it all (`loop`). Reads `state`; never imports
`grants` or `lanes`."""
