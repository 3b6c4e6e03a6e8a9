"""Developer tools for tuning k3core's kernels on a GPU: checked config sweeps whose winners go into the tuning
tables (`kernels/triton/tuning.py`, `kernels/triton/tuning_ops.py`), Nsight Compute targets and report helpers,
and the per-kernel time ranking of a profiled model step. Run as `python -m tools.tune.<module>`; each sweep has a
`--smoke` mode for the CPU."""
