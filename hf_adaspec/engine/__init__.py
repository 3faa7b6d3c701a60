"""The engine: the one speculative loop (``loop``), the ragged KV cache, verification, the per-row
stats and the draft's prefix store."""
