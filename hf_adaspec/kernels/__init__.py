"""Compute kernels of our own, where no library reaches the hardware's speed (issue 44): C sources built on first
use with the machine's C compiler and called through ``ctypes``. Nothing here imports the rest of the package."""
