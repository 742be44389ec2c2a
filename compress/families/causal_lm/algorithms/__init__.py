"""The causal LM's algorithms on plain arguments: distillation and its loss (`distill`),
activation-aware scaling before low-bit quantization (`equalize`), structured pruning
(`pruning`) and quantization-aware training's fake quantization (`qat`).
"""
