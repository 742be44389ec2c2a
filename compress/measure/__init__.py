"""What is measured of a model: accuracy, latency, memory and an export's parity (a causal
LM's generation figures are its family's: compress.families.causal_lm.generation).
"""
