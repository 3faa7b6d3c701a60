"""The engine: the one speculative loop (``loop``), verification, the per-row stats, and one request's
assembly from the mode registry (``run``: ``build_run``, ``record_run``, ``SpeculationState``), the thread chooser
(``threads``) and the owner of what is kept for an enabled model (``owner``: ``ModelState``)."""
