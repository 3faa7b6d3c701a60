"""``python -m hf_adaspec.gpu_check``: runs ``gpu_check.main``."""

import sys

from .gpu_check import main

sys.exit(main())
