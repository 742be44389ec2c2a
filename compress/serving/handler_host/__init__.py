"""What every engine that runs an archive's handler outside TorchServe shares (LitServe's
`compress.serving.litserve`, Ray Serve's `compress.serving.ray`): none of it imports an
engine.

- `context`: what TorchServe's `Context` gives a handler, and `send_chunk` for streams.
- `handler`: the archive's handler imported from its unpacked folder as TorchServe imports
  it, TorchServe's token check and defaults, and an answer's bytes.
- `body`: a request body's limits; `errors`: TorchServe's error bodies, internal errors
  answered with an id, and the error line that ends a stream that has begun.
"""
