"""The operator's shell: kopf watches, the decision loop, Kubernetes objects built from plans.

Everything that talks to the API server lives here; the decisions it applies come from the pure
core (`continuum_operator.core`). `continuum operator` starts it (`kube.run`).
"""
