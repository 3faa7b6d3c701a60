"""The public entry: ``load``, ``enable`` (``model.generate(..., speculation=...)``) and ``generate_batch``."""
