"""Compute kernels of our own, where no library reaches the hardware's speed (on an AVX2-only CPU bitsandbytes' NF4
took 1.5–1.9 s for a 1.5B model's token): C sources built on first use with the machine's C compiler and called
through ``ctypes``. Nothing here imports the rest of the package."""
