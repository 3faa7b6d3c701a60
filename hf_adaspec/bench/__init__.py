"""Benchmarks: the prompts and their splits (``prompts``), every method timed interleaved per prompt
(``bench``) or per batch (``batch``), the hindsight oracle that bounds them (``oracle``, ``oracle_inputs``),
and perplexity scored as llama.cpp's ``llama-perplexity`` scores it (``perplexity``)."""
