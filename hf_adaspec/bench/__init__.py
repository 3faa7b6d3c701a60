"""Benchmarks: the prompts and their splits (``prompts``), every method timed interleaved per prompt
(``bench``) or per batch (``batch``), and the hindsight oracle that bounds them (``oracle``, ``oracle_inputs``)."""
