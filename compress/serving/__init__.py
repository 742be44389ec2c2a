"""The host side of serving: building a TorchServe archive, starting, watching and stopping
TorchServe, and load tests against a served endpoint. What runs inside a served archive
lives in the top-level `serve` package."""
