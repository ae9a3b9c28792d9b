"""The process that wires the rooms together: `continuum operator` (`run`: kopf's watches, the
loops, the webhook, metrics), leader election by a coordination Lease (`leader`), and
`continuum release-finalizers` (`release`). The only room that may import every other."""
