"""What is measured of a model: accuracy, latency, memory, generation speed and an export's
parity.
"""
