"""How every process of the project talks to the API server: the request each verb sends and
what an answer means (`api`, and its blocking adapter for the CLI), the adapter on the event loop
(`async_api`) the operator's loops use, how both log in without the `kubernetes` package
(`login`: the pod's ServiceAccount or a kubeconfig), JSON merge patches as the server applies them
(`merge_patch`), and what of an object a cache keeps (`kept`).

The bottom room: it knows no plan, grant or loop. Above it: `base`, and every room that writes."""
