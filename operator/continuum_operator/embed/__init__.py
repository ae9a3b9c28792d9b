"""`continuum embed`: an embed lane's process, llama-cpp-python in embedding mode (mean pooling).

The shell around `core.embed`: `embed.lane` holds the llama.cpp context and turns each load's
log into a receipt; `embed.runtime` serves `/v1/embeddings`, admits each request against the
lane's lease (`status.placement`, written by the operator), calibrates before the first
request, and writes the lane's `status.runtime` (largest context embedded, receipts), the one
field it owns. llama-cpp-python is imported here and nowhere in the pure core.
"""
