"""What the tests share: builders of objects, fakes of the API server and of llama-server,
waiting, Helm, and the helpers several test modules use. No test module imports another."""
