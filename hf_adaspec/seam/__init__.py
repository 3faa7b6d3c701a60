"""The transformers seam: ``enable`` (the wrapped ``generate``), ``generate_batch`` and ``hf_compat``
(every touch of transformers internals)."""
