"""The reranker family's handler (a TorchServe handler for cross-encoders) and the requests it
reads; shipped whole in a reranker archive as `serve/reranker/`."""
