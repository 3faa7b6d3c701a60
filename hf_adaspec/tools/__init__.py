"""Tools around the core: the CLI, the benchmarks and their oracle, the live runner and the playground."""
