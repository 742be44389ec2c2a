"""The causal-LM micro benchmarks: decode, speculative decoding, a step's overhead,
structured output, chunked prefill, the grammar engines and the grouped kernels."""
