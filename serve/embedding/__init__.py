"""The embedding family's server: what an embedding archive ships beside its exported file.

In the repository this is `serve.embedding`; in an unpacked archive it is the top-level
package `embedding` (the archive's root on `sys.path`), whose modules import each other
relatively and the shared serving modules (`batch_answers`, `http_answers`, `text_inputs`,
`runtimes`, `worker_threads`, `handler_metrics`) from the archive's root. Nothing is
imported here.
"""

# the modules an archive ships in `embedding/`: the handler (and its answers), its requests
SERVING_MODULES = ("handler", "requests")
