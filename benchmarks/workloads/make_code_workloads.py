"""Generate ``code.jsonl``: code-assistant benchmark prompts outside Spec-Bench, in Spec-Bench's JSONL format.

Spec-Bench has a coding category, but it is small and English-heavy; speculative decoding behaves
differently on code, and above all on *editing*, where the answer copies most of the prompt (the case
where prompt-lookup and long drafts pay off most). This script builds 16 such prompts from real
functions of the running interpreter's standard library, in two categories of 8:

* ``code-completion`` (question_id 10001-10008): a function's signature, docstring and roughly the first
  40% of its body lines (cut at the end of a complete statement), with "Complete the following Python
  function. Reply with the whole function in one code block."
* ``code-editing`` (question_id 10009-10016): a whole function (20-60 lines) with an edit instruction
  (type hints, renaming, a docstring, f-strings, input validation, ...) and "Reply with the whole edited
  function in one code block.", so that the answer repeats most of the prompt.

Each line is one JSON object: ``question_id`` (int), ``category`` (str), ``turns`` (a list with one str,
the user message) and ``source`` (str: interpreter and version, the module file relative to the stdlib
root, and the function, e.g. "CPython 3.11.7 Lib/textwrap.py: dedent"). The list of functions and
instructions below is fixed, so the output is deterministic for a given Python version; the code is read
with ``inspect.getsource`` (pure-Python functions only), and methods are dedented.

License: the code in the prompts is taken from CPython's standard library, which is distributed under
the Python Software Foundation License (PSF License Version 2); see https://docs.python.org/3/license.html.

Run (from the repository root; writes benchmarks/workloads/code.jsonl atomically):

    python benchmarks/workloads/make_code_workloads.py

The last line on stdout is one JSON object: the output path, the number of prompts and the count per
category.
"""

import argparse
import ast
import importlib
import inspect
import json
import platform
import sysconfig
import textwrap
from pathlib import Path

from hf_adaspec.files import atomic_write

OUTPUT = Path(__file__).resolve().parent / "code.jsonl"

COMPLETION_FRACTION = 0.4
MIN_LINES, MAX_LINES = 15, 70  # lines of code in each prompt
MAX_CHARS = 2500  # characters of code in each prompt (~700 tokens)

COMPLETION_MESSAGE = (
    "Complete the following Python function. Reply with the whole function in one code block.\n\n```python\n{code}\n```"
)
EDITING_MESSAGE = "{instruction}. Reply with the whole edited function in one code block.\n\n```python\n{code}\n```"

# (module, qualified function name) for code-completion, question_id 10001..10008.
COMPLETION = [
    ("textwrap", "dedent"),
    ("difflib", "get_close_matches"),
    ("statistics", "quantiles"),
    ("heapq", "nsmallest"),
    ("csv", "Sniffer.has_header"),
    ("urllib.parse", "urlsplit"),
    ("json.decoder", "py_scanstring"),
    ("ipaddress", "summarize_address_range"),
]

# (module, qualified function name, instruction) for code-editing, question_id 10009..10016.
EDITING = [
    (
        "string",
        "Formatter._vformat",
        "Rename the variable `auto_arg_index` to `next_auto_index` everywhere, including the keyword argument",
    ),
    ("email.utils", "formataddr", "Replace the %-style string formatting with f-strings"),
    (
        "locale",
        "_group",
        "Add a docstring in Google style (with Args and Returns sections) that explains what the function does",
    ),
    (
        "colorsys",
        "rgb_to_hls",
        "Add input validation that raises ValueError if any of r, g or b is not a number between 0.0 and 1.0 inclusive",
    ),
    ("calendar", "TextCalendar.formatyear", "Add type hints to every parameter and the return value"),
    (
        "quopri",
        "decode",
        "Split every line that holds several statements joined with semicolons into one statement per line, "
        "and replace `while 1:` with `while True:`",
    ),
    (
        "graphlib",
        "TopologicalSorter.done",
        "Convert the comments to proper sentences: capitalize the first word, fix the grammar and end each "
        "comment with a period",
    ),
    (
        "shutil",
        "get_terminal_size",
        "Move the repeated parsing of the COLUMNS and LINES environment variables into a nested helper "
        "function `_env_int(name)` that returns 0 when the variable is missing or not an integer, and use it "
        "for both",
    ),
]


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)  # e.g. urlsplit is wrapped by functools.lru_cache


def _source(module: str, qualname: str) -> tuple[str, str]:
    """The function's dedented source and its ``source`` field."""
    obj = _resolve(module, qualname)
    code = textwrap.dedent(inspect.getsource(obj)).rstrip() + "\n"
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    path = Path(inspect.getsourcefile(obj)).resolve().relative_to(stdlib).as_posix()
    where = f"{platform.python_implementation()} {platform.python_version()} Lib/{path}: {qualname}"
    return code, where


def _partial(code: str) -> str:
    """Signature, docstring and about the first 40% of the body lines, cut after a complete statement."""
    lines = code.splitlines()
    func = ast.parse(code).body[0]
    assert isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)), func
    body = func.body
    first = body[0]
    has_doc = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    body_start = first.end_lineno if has_doc else first.lineno - 1  # lines[:body_start] = signature (+ docstring)
    n_body = len(lines) - body_start
    target = body_start + COMPLETION_FRACTION * n_body
    # Cut points: the last line of any statement of the body (nested ones too), after the docstring.
    ends = sorted(
        {
            node.end_lineno
            for node in ast.walk(func)
            if isinstance(node, ast.stmt)
            and node is not func
            and node.end_lineno > body_start
            and node.end_lineno < len(lines)
        }
    )
    cut = min(ends, key=lambda end: (abs(end - target), end))
    return "\n".join(lines[:cut]).rstrip() + "\n"


def _check(code: str, where: str) -> None:
    n = len(code.splitlines())
    if not (MIN_LINES <= n <= MAX_LINES and len(code) <= MAX_CHARS):
        raise SystemExit(
            f"{where}: {n} lines, {len(code)} chars (want {MIN_LINES}-{MAX_LINES} lines, <= {MAX_CHARS} chars)"
        )


def build() -> list[dict]:
    rows = []
    qid = 10001
    for module, qualname in COMPLETION:
        code, where = _source(module, qualname)
        partial = _partial(code)
        _check(partial, where)
        rows.append(
            {
                "question_id": qid,
                "category": "code-completion",
                "turns": [COMPLETION_MESSAGE.format(code=partial.rstrip("\n"))],
                "source": where,
            }
        )
        qid += 1
    for module, qualname, instruction in EDITING:
        code, where = _source(module, qualname)
        _check(code, where)
        if not 20 <= len(code.splitlines()) <= 60:
            raise SystemExit(f"{where}: an editing function should have 20-60 lines")
        rows.append(
            {
                "question_id": qid,
                "category": "code-editing",
                "turns": [EDITING_MESSAGE.format(instruction=instruction, code=code.rstrip("\n"))],
                "source": where,
            }
        )
        qid += 1
    return rows


def write_atomic(rows: list[dict], output: Path) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write(output, lambda f: f.write(text.encode("utf-8")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", type=Path, default=OUTPUT, help="where to write the JSONL (default: %(default)s)")
    args = ap.parse_args()
    rows = build()
    write_atomic(rows, args.output)
    categories: dict[str, int] = {}
    for row in rows:
        categories[row["category"]] = categories.get(row["category"], 0) + 1
        print(f"{row['question_id']}  {row['category']:15}  {row['source']}")
    print(json.dumps({"output": str(args.output), "prompts": len(rows), "categories": categories}))


if __name__ == "__main__":
    main()
