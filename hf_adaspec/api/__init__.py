"""The public entry: ``enable`` (``model.generate(..., speculation=...)``) and ``generate_batch``."""
