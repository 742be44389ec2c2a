"""What the benchmark suites share: the command line (`cli`), the peers' environments
(`venv`), child processes and their rounds (`rounds`, `child_main`), the GEMM and CPU peaks
(`gemm`, `cpu_peak`), the machine (`machine`), served processes (`servers`), the tables'
arithmetic (`spread`, `flops`) and the paths (`paths`). It imports no suite."""
