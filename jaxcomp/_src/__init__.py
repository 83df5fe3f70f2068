"""jaxcomp's implementation; the public names are re-exported by ``jaxcomp`` and its public modules."""
