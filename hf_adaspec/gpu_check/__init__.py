"""The GPU check (``python -m hf_adaspec.gpu_check``, ``make gpu-check``): the project's pass over what only a
GPU can tell, run from a checkout (it reads ``benchmarks/traces``, writes ``model_cards/gpu/``), so it is not in
the wheel and nothing in the package imports it."""
