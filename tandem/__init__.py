"""The `tandem` command: the top layer, over the control plane (`orchestrator`) and the
benchmarks (`benchmarks`), which are imported by nothing else."""
