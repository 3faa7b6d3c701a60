"""Argument checks the commands share: a bad argument is a usage error (exit code 2) whose one-line message
names the fix, raised before any model is loaded or any output written."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import typer


@contextlib.contextmanager
def usage_errors(*errors: type[Exception], hint: str | None = None) -> Iterator[None]:
    """``with usage_errors(ValueError, hint="--x"):`` turns those errors into a usage error (exit code 2, the
    message printed as one line, no traceback); the library's messages name the fix."""
    try:
        yield
    except errors as e:
        raise typer.BadParameter(" ".join(str(e).split()), param_hint=hint) from None


def check_output(path: Path, flag: str = "--output", folder: bool = False) -> None:
    """Refuse, before any work, an output that is a folder where a file belongs (or, with ``folder``, a file
    where a folder belongs)."""
    if not folder and path.is_dir():
        raise typer.BadParameter(f"{path} is a folder; give a file path, e.g. {path / 'out.json'}", param_hint=flag)
    if folder and path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is a file; give a folder (new or one this command wrote)", param_hint=flag)


def check_prompts_file(path: Path) -> None:
    """Refuse a prompts file that is not Spec-Bench style JSONL: every line a JSON object with an integer
    ``question_id``, a ``category`` and a non-empty list of ``turns`` (a missing file is ``load_prompts``' error)."""
    if path.is_dir():
        raise typer.BadParameter(
            f"{path} is a folder; give a Spec-Bench style JSONL file, or leave --prompts out "
            "for the packaged Spec-Bench subset",
            param_hint="--prompts",
        )
    if not path.is_file():
        return
    fix = "fix that line, or leave --prompts out for the packaged Spec-Bench subset"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise typer.BadParameter(f"{path} is unreadable ({e}); {fix}", param_hint="--prompts") from None
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            ok = (
                isinstance(row, dict)
                and isinstance(row.get("category"), str)
                and isinstance(row.get("turns"), list)
                and bool(row["turns"])
                and str(row.get("question_id")).strip().lstrip("-").isdigit()
            )
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise typer.BadParameter(
                f"line {number} of {path} is not a JSON object with question_id (an integer), "
                f"category and turns (a list); {fix}",
                param_hint="--prompts",
            )


def parse_methods(text: str, known: tuple[str, ...], flag: str, draft: str, needs_draft: tuple[str, ...]) -> list[str]:
    """The comma-separated methods of ``flag``: known ones, plain among them, none that needs a draft model
    with ``--draft none``; else a usage error naming the fix."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in known]
    if unknown or "plain" not in methods:
        raise typer.BadParameter(
            f"{text!r}: choose from {', '.join(known)}, including plain (speedups are relative to it)", param_hint=flag
        )
    drafted = [m for m in methods if m in needs_draft]
    if draft == "none" and drafted:
        others = ",".join(m for m in known if m not in needs_draft)
        raise typer.BadParameter(
            f"{', '.join(drafted)} need a draft model; name one with --draft, or run only "
            f"methods without one: {flag} {others}",
            param_hint="--draft none",
        )
    return methods


def parse_sizes(text: str, flag: str = "--batch-size") -> list[int]:
    """Comma-separated sizes (each an integer >= 1), sorted and deduplicated; a usage error of ``flag`` else."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise typer.BadParameter(f"{flag} {text!r}: comma-separated integers, e.g. 1,2,4,8,16") from None
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter(f"{flag} {text!r}: sizes must be >= 1")
    return sizes
