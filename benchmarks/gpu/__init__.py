"""The GPU paths: the GPU test tier and 2:4 sparse against dense fp16 (`check.sh`,
`sparse24`)."""
