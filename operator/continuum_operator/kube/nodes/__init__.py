"""What the operator tells each node: the pods it placed there, written into the node's
NodeBoard `spec.placed` so the agent can charge a GPU process to its Engine or lane."""
