"""The Kubernetes objects built from plans and specs, as plain dicts with no API calls: the
engine's Deployment, Service and identity (`engine_objects`, `engine_identity`), a lane's
(`lane_objects`), the facts Job, the GPU environment and RuntimeClass of every pod the operator
builds (`gpu_env`), the park store's volume and the PriorityClasses. The loops apply them; the
cache reads their labels. Beside `ledger`, below `state`."""
