"""The EmbedLanes' reconciler: one pass over one lane, placed beside its engine and charged
where it resides (`lane_pass`), and the loop that applies it (`loop`). Reads `state`."""
