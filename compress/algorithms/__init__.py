"""The compression algorithms on plain arguments: PT2E quantization, pruning, distillation,
sensitivity, and their causal-LM variants side by side.
"""
