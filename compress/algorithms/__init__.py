"""The family-independent compression algorithms on plain arguments: PT2E quantization,
pruning, distillation, sensitivity (the causal LM's variants are in
compress.families.causal_lm.algorithms).
"""
