"""Serving under load and faults: a classifier and a causal-LM archive served by `compress
serve` (`run`, the causal-LM faults in `generation`)."""
