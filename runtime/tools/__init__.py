"""Tools over a loaded model: benchmarks, thread sweeps, the baseline gate and evaluation."""
