"""The model backend: every touch of transformers internals (``hf_compat``), the KV cache of a ragged
batch (``ragged``) and the draft's prefix store (``draft_prefix``)."""
