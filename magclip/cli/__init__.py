"""Console entry points; train/, eval/ and tools/ hold the same commands as scripts of a checkout."""
