"""What the operator has seen of the cluster, which every loop reads and none reads the API
for: the cache of Engines, boards, nodes, pods and lanes fed by kopf's watch handlers
(`cache`, `handlers`), the Minds, MindClasses and TokenQuotas (`mind_cache`), what holds each
node's memory (`occupancy`), the agents' Leases as counted here (`lease_renewal`) and what of a
lane is indexed (`lane_index`). The loops above talk to each other only through it: a change one
writes marks the keys another must decide again."""
