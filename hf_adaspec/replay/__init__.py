"""Replay: greedy traces (``trace``), caches and a head that answer from them (``virtual``), the library's
controllers run on them by a virtual clock (``replay``, ``report``), and the vLLM export (``export_vllm``)."""
