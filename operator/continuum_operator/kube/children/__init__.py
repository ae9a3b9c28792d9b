"""A mind's children: what makes a pod hers (`membership`), the pods her workloads make
(`workloads`), and the mutating webhook that runs them below the engine serving her (`webhook`)."""
