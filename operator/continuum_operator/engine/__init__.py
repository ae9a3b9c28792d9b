"""The engine runtime's shell: the turn client now; the gateway and receipts as they land."""
