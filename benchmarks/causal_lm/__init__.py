"""Causal-LM peers: SmolLM2 against llama.cpp (and zentorch) on the same GGUF (`peers`),
served against llama-server (`served`), and the decode micro benchmarks (`micro`)."""
