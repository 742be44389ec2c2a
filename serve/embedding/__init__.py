"""The embedding family's server: what an embedding archive ships beside its exported file,
as `serve/embedding/` (the handler and its requests), with the shared serving modules of
`serve/` (`batching`, `http_answers`, `runtimes`, `worker_threads`, `handler_metrics`), which
it imports as `serve.<module>`. Nothing is imported here.
"""
