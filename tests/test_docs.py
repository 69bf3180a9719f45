"""The documentation stays true to the code: every `chimera` command in a code block parses,
every script it names exists, every relative link and anchor resolves, and every section of
benchmarks/RESULTS.md names a command that reproduces its figures (no torch, no processes).
"""

import re
import shlex
from pathlib import Path

import pytest

from chimera.cli import build_parser, train_cmd
from chimera.cli.common import UsageError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
COMMAND = re.compile(r"`(chimera |python benchmarks/|make |torchrun )[^`]*`")


def _shell_lines(text: str) -> list[str]:
    """The lines of bash and console blocks, continuations joined, console prompts stripped."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang not in ("bash", "console"):
            continue
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            out.append(line.strip())
    return out


def _chimera_argv(line: str) -> list[str] | None:
    """The arguments after `chimera` (or `python -m chimera`) on a shell line, else None."""
    line = re.sub(r"\[[^\]]*\]", "", line)  # [--optional FLAGS] in a usage line
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # ENV=value prefixes
        words.pop(0)
    if words[:1] == ["chimera"]:
        return words[1:]
    if "-m" in words and words.index("-m") + 1 < len(words) and words[words.index("-m") + 1] == "chimera":
        return words[words.index("-m") + 2:]
    return None


def _commands():
    for doc in DOCS:
        for line in _shell_lines(doc.read_text()):
            argv = _chimera_argv(line)
            if argv is not None:
                yield pytest.param(argv, id=f"{doc.name}: {' '.join(argv)[:60]}")


def _parse(argv: list[str]):
    """``argv`` parsed as `chimera` would: argparse routes, and `train` parses its own flags
    (generated from the config's sections); a --config file the docs name is not read."""
    args = build_parser().parse_args(argv)  # a bad flag exits 2 with one line
    if args.command == "train":
        rest = list(args.argv)
        if "--config" in rest:
            del rest[rest.index("--config"):rest.index("--config") + 2]
        train_cmd.parse(rest)  # a bad flag raises UsageError
    return args


@pytest.mark.parametrize("argv", list(_commands()))
def test_documented_command_parses(argv, capsys):
    if "--help" in argv:
        with pytest.raises(SystemExit) as exit_:
            _parse(argv)
        assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
        return
    args = _parse(argv)
    assert getattr(args, "func", None) is not None


def test_a_wrong_train_flag_in_the_docs_would_be_caught():
    with pytest.raises(UsageError):
        _parse(["train", "--no-such-flag", "3"])


def test_documented_scripts_exist():
    named = {m for doc in DOCS for m in re.findall(r"python (benchmarks/\w+\.py)", doc.read_text())}
    assert named, "no benchmark script named in the docs"
    missing = sorted(m for m in named if not (ROOT / m).is_file())
    assert not missing, f"scripts named in the docs but absent: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_has_no_pointer_outside_the_repository():
    assert "../shared" not in (ROOT / "README.md").read_text()


def test_every_results_section_names_its_command():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = re.split(r"^(?=##+ )", FENCE.sub(lambda m: m.group(0).replace("#", ""), text), flags=re.M)[1:]
    assert len(sections) >= 8
    fenced_commands = re.compile(r"^\$? ?(chimera|python benchmarks/|make )", re.M)
    bare = [s.splitlines()[0] for s in sections if s.partition("\n")[2].strip()  # not a heading alone
            and not COMMAND.search(s) and not fenced_commands.search(s)]
    assert not bare, f"sections of RESULTS.md without a command that reproduces them: {bare}"


def test_every_make_target_the_docs_and_pyproject_name_exists():
    """`make X` in the docs and in pyproject.toml (the slow marker's `make test-slow`) is a
    target of the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {m for doc in DOCS for m in re.findall(r"`make ([a-z][\w-]*)", doc.read_text())}
    named |= set(re.findall(r"\bmake ([a-z][\w-]*)", (ROOT / "pyproject.toml").read_text()))
    assert "test-slow" in named
    assert named <= targets, f"make targets named but absent: {sorted(named - targets)}"
