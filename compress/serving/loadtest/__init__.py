"""Load tests of a served endpoint on this machine, what `compress loadtest` runs: loopback
URLs only, `concurrency` requests in flight on persistent connections until `requests` were
sent, nearest-rank percentiles.

- `predictions`: a classifier's or an embedding model's JSON bodies (requests/s, latency,
  the batch sizes the server formed).
- `generation`: a causal LM's streamed NDJSON answers (tokens/s, time to first token).
- `chat`: OpenAI's streamed `/v1/chat/completions` (compress's servers or llama.cpp's
  `llama-server`): time to first token and inter-token latency too; `chat_stream` reads
  one answer's server-sent events, `chat_workload` writes the request bodies (a shared
  system prompt among them).
- `arguments`: the URL and counts every load test accepts; `workers`: the threads and
  their connections; `report`: tables, the failure line and `loadtest.json`.
"""
