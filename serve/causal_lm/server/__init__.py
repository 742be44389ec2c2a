"""The causal-LM server: what a TorchServe or LitServe archive adds to the runtime
(`causal_lm.runtime`): the handler, its requests and answers (native and OpenAI), structured
output and tools, the continuous batch with its prefill and prefix cache, and the compiled
decode steps. An archive ships it as `serve/causal_lm/server/` beside `runtime/`; it imports
the runtime relatively and the shared serving modules as `serve.<module>`."""
