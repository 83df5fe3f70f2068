"""jaxcomp's experiments: the comparison, benchmarks, scaling and netbench."""
