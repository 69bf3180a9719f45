"""Move modules of the package and rewrite every dotted path that names them (imports, strings
naming modules, docs). Rerunnable: a move already made is skipped.

    python tools/move_modules.py            # the moves of issue 24
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# old dotted path -> new dotted path
MOVES = {
    "chimera.data": "chimera.data",  # data.py -> data/__init__.py (the path stays)
    "chimera.data_formats": "chimera.data.formats",
    "chimera.data_text": "chimera.data.text",
    "chimera.data_tokens": "chimera.data.tokens",
    "chimera.data_datasets": "chimera.data.datasets",
    "chimera.bpe": "chimera.data.bpe",
    "chimera.comm_plan": "chimera.check.comm_plan",
    "chimera.rendezvous": "chimera.check.rendezvous",
    "chimera.validate": "chimera.check.validate",
    "chimera.validation_error": "chimera.check.validation_error",
    "chimera.issued": "chimera.check.issued",
    "chimera.bounds": "chimera.theory.bounds",
    "chimera.formulas": "chimera.theory.formulas",
    "chimera.tables": "chimera.theory.tables",
    # a trace is the timeline's file format: sim reads it (replay, profiles), viz draws it
    "chimera.viz.trace": "chimera.sim.trace",
    # what the trainer needs from a model: below both train and hf (which implements it)
    "chimera.train.source_base": "chimera.models.source",
}
PACKAGES = {"chimera.data": "The data a run reads: formats, text, tokens, the tokenizer trainer.",
            "chimera.check": "Checks before and during a run: the communication plan, the "
                             "rendezvous, validation of a schedule.",
            "chimera.theory": "The paper's closed forms: bubble bounds, formulas, tables."}


def path_of(dotted: str, package: bool = False) -> pathlib.Path:
    rel = pathlib.Path(*dotted.split("."))
    return SRC / rel / "__init__.py" if package else SRC / rel.with_suffix(".py")


def move_files() -> None:
    for old, new in MOVES.items():
        src = path_of(old)
        dst = path_of(new, package=new in PACKAGES)
        if not src.exists() or src == dst or dst.exists():  # moved already
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(src), str(dst)], check=True, cwd=ROOT)
    for package, doc in PACKAGES.items():
        init = path_of(package, package=True)
        if not init.exists():
            init.write_text(f'"""{doc}"""\n')
            subprocess.run(["git", "add", str(init)], check=True, cwd=ROOT)


def rewrite(text: str) -> str:
    renamed = {o: n for o, n in MOVES.items() if o != n}
    # `from chimera import a, b`: the names move package (and, for data_*, name)
    def from_chimera(m: re.Match) -> str:
        indent, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
        groups: dict[str, list[str]] = {}
        for name in names:
            new = renamed.get(f"chimera.{name}", f"chimera.{name}")
            parent, _, leaf = new.rpartition(".")
            groups.setdefault(parent, []).append(leaf)
        return "\n".join(f"{indent}from {p} import {', '.join(ls)}" for p, ls in groups.items())
    text = re.sub(r"^([ \t]*)from chimera import ([\w, ]+)$", from_chimera, text, flags=re.M)
    pattern = re.compile(r"\bchimera\.(" + "|".join(re.escape(o.split(".", 1)[1]) for o in renamed)
                         + r")\b(?![\w])")
    return pattern.sub(lambda m: renamed["chimera." + m.group(1)], text)


def rewrite_tree() -> list[pathlib.Path]:
    changed = []
    for pattern in ("src/**/*.py", "tests/**/*.py", "examples/**/*.py", "benchmarks/**/*.py",
                    "tools/**/*.py", "docs/**/*.md", "*.md", "benchmarks/*.md"):
        for path in ROOT.glob(pattern):
            if path.name == "move_modules.py":
                continue
            text = path.read_text()
            new = rewrite(text)
            if new != text:
                path.write_text(new)
                changed.append(path)
    return changed


if __name__ == "__main__":
    move_files()
    for path in rewrite_tree():
        print("rewrote", path.relative_to(ROOT))
    sys.exit(0)
