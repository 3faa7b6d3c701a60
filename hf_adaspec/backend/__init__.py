"""The model backend: every touch of transformers internals (``hf_compat``), the KV cache of a ragged
batch (``ragged``) over a store (``stores``: a ``DynamicCache`` or a ``static_kv`` arena, owned per model by
``arenas``), a draft head's (``head_kv``), the draft's prefix store (``draft_prefix``), and the one place a
request's caches are made (``caches``)."""
