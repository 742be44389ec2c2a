"""compress's second serving engine: LitServe (FastAPI and uvicorn, no Java) serving the same
unpacked `.mar` with the same handler classes as TorchServe.

- `launch`: the host side, what `compress serve --engine litserve` runs: start the server
  process in the background, wait until it answers, record it in server.json.
- `main`: that server process: a `LitServer` with the API below, on 127.0.0.1, umask 0o077,
  its dead workers restarted.
- `worker`: LitServe's API in its inference worker: the archive's handler, imported from
  the unpacked folder as TorchServe imports it; `loop`: its batches, answers and cancels.
- `context`: what TorchServe's `Context` gives a handler, and `send_chunk` for streams.
- `routes`: TorchServe's URLs as a LitServe spec (`/predictions/MODEL[/VERSION[/PATH]]`,
  `/ping`) and its token check; a streamed answer's status and headers are those the
  handler set before its first chunk. `body`: the body's limits; `inflight`: timeouts,
  dead workers and client disconnects; `errors`: TorchServe's error bodies, internal
  errors answered with an id.
"""
