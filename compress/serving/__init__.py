"""The host side of serving: building a TorchServe archive, starting, watching and stopping
its server (`server`, each engine's launcher in `torchserve/` and `litserve/`), and load
tests against a served endpoint (`loadtest/`). What runs inside a served archive lives in
the top-level `serve` package."""
