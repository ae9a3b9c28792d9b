"""The grant ledger as the API server holds it and its vocabulary: the entries read into the
allocator and written back (`grant_ledger`), the GrantLedger as the cached Engine body carries it
(`cached`), the step's journal, the transition log's lines, and routing (which Engine each Mind
goes to, with what demand, under which quota). The grants loop (`kube.grants`) is its one
writer; the Engines' and lanes' loops read it. Beside `workloads`, below `state`."""
