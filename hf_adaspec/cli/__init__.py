"""The ``hf-adaspec`` command line (``cli``: its app and the generate, bench and playground commands; the
other commands in modules of their own), its shared argument checks (``checks``) and model pair (``pair``)."""
