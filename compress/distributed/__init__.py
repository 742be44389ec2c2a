"""More than one process: torchrun launches, the process group and FSDP sharding."""
