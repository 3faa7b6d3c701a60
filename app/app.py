"""The hf-adaspec playground: ``python app/app.py [--pair qwen|smollm2] [--port 7860]``.

The same as ``hf-adaspec playground``; the page itself lives in ``hf_adaspec/playground/playground.py``.
"""

import typer

from hf_adaspec.cli.cli import playground

if __name__ == "__main__":
    typer.run(playground)
