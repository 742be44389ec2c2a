"""Training: activation checkpointing's memory and time, and FSDP killed and resumed."""
