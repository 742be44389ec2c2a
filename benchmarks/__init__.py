"""compress's benchmarks: suites of scripts over one harness, each run from the repository
root as `python -m benchmarks.<suite>.<module>` (benchmarks/README.md). Imports nothing, so
that a child process in a peer's own environment can import the harness alone."""
