"""The grants loop, on the leader only: Minds reconciled through their Engine's ledger. Its
pass's inputs (`pass_inputs`), the ledger's write and what this leader keeps of long queues
(`ledger_write`, `ledger_tails`, `ledger_facts`), each Mind's status projected from her entry and
written (`mind_status`, `mind_writes`, `write_queue`), the tokens each TokenQuota's namespace
holds (`quota_use`), and the loop (`loop`). Reads `state`; never imports `engines` or `lanes`."""
