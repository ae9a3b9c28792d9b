"""What the tests share: builders of objects, fakes of the API server and of llama-server,
waiting, Helm, the local control plane and the real llama-server of the e2e tests, and the helpers
several test modules use. No test module imports another (tests/unit/project checks it of the
unit and the e2e tests)."""
