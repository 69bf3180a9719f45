"""Reading a ``--config`` TOML file: what may be read, where each value was written, and
messages about its values that name the file and the line.

Only a regular file of at most ``MAX_BYTES`` is read (a FIFO would block, a device never
end), as UTF-8 (a byte-order mark is skipped). Its tables are checked for shape here (a
section's key at the top level, a key under the wrong table, an unknown option), each
refusal naming ``FILE:LINE``; its values are checked by the sections when the run's
configuration is made, after flags have overridden them, and :meth:`ConfigFile.blame`
rewrites those messages so that a value the file gave is named by its file, line, table and
key, not by a flag the user never typed.

Imports no torch (the CLI reads the file before torch loads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import re
import stat

from chimera.schedules import schemes
from chimera.train import portable
from chimera.schedules.registry import option_declarations
from chimera.train.sections import FLAT, SECTIONS, ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

MAX_BYTES = 1 << 20  # a run's configuration is a few hundred bytes; more is not one
OPTIONS = ("pipeline", "options")  # the table of the scheme's options: [pipeline.options]

# a table header ([pipeline], [pipeline.options]) and a key (bare, quoted or dotted) at a
# line's start; multi-line strings are skipped by counting their quotes
_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """A config file read and checked for shape: ``tables`` as TOML parsed them, the line of
    every key (``lines``: key path -> 1-based line), and ``kept``, the flat names of the
    file's values that no flag overrode (None: all of them)."""

    path: str
    tables: dict
    lines: dict
    kept: frozenset | None = None

    # -- what the file sets ----------------------------------------------------------
    def values(self) -> dict:
        """Flat name -> value of every field the file sets (lists as tuples, as the sections
        hold them), scheme options not included."""
        return {key: _frozen(value) for name, table in self.tables.items()
                for key, value in table.items() if key != "options"}

    def options(self) -> dict:
        return dict(self.tables.get("pipeline", {}).get("options", {}))

    def keeping(self, flat: dict, options: dict) -> "ConfigFile":
        """This file, knowing which of its values survived the flags: those equal in ``flat``
        (and ``options``) to the file's."""
        kept = {k for k, v in self.values().items() if flat.get(k) == v}
        kept |= {k for k, v in self.options().items() if options.get(k) == v}
        return dataclasses.replace(self, kept=frozenset(kept))

    # -- where ---------------------------------------------------------------------
    def line(self, *path: str) -> int | None:
        """The line of key ``path`` (or of the nearest table above it that has one)."""
        for end in range(len(path), 0, -1):
            if path[:end] in self.lines:
                return self.lines[path[:end]]
        return None

    def at(self, *path: str) -> str:
        """``FILE:LINE`` of key ``path`` (``FILE`` when no line is known)."""
        line = self.line(*path)
        return f"{self.path}:{line}" if line else self.path

    def key_of(self, name: str) -> tuple[str, ...] | None:
        """The key path of flat name ``name`` in the file, if the file gave it and it was kept."""
        if self.kept is not None and name not in self.kept:
            return None
        section = FLAT.get(name)
        if section is not None and name != "options" and name in self.tables.get(section, {}):
            return (section, name)
        if name in self.options():
            return (*OPTIONS, name)
        return None

    # -- messages about its values ---------------------------------------------------
    def locate(self, message: str) -> str | None:
        """``message`` with every flag whose value came from this file named as the file's
        table and key, prefixed with ``FILE:LINE`` of the first; None when it names none."""
        found, pieces, end = [], [], 0
        for match in re.finditer(r"--([a-z][a-z0-9-]*)\b|(?<=\boption )([a-z][a-z0-9_]*)\b", message):
            key = self.key_of((match.group(1) or match.group(2)).replace("-", "_"))
            if key is None:
                continue
            found.append(key)
            again = f" (line {self.line(*key)})" if len(found) > 1 else ""
            pieces += [message[end:match.start()], f"[{'.'.join(key[:-1])}] {key[-1]}{again}"]
            end = match.end()
        if not found:
            return None
        return f"{self.at(*found[0])}: {''.join(pieces)}{message[end:]}"

    @contextlib.contextmanager
    def blame(self):
        """Messages of ``ConfigError`` raised inside, about values this file gave, name it."""
        try:
            yield
        except ConfigError as exc:
            located = self.locate(str(exc))
            if located is None:
                raise
            raise ConfigError(located) from None


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def read(path: str) -> ConfigFile:
    """``path`` read, parsed and checked for shape (ConfigError, one line, otherwise)."""
    text = _text(path)
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not TOML: {exc}") from None
    source = ConfigFile(str(path), tables, _key_lines(text))
    check_shape(tables, source)
    # a checkpoint's config.toml: its paths relative to its folder (chimera.train.portable)
    return dataclasses.replace(source, tables=portable.resolve(tables, path))


def _text(path: str) -> str:
    """The file's text: a regular file, at most MAX_BYTES, UTF-8."""
    where = f"--config {path}"
    if not str(path):
        raise ConfigError("--config: an empty path; give a TOML file")
    try:
        mode = os.stat(path).st_mode  # before opening: a FIFO's open blocks
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{where}: is {_kind(mode)}, not a file: give a TOML file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_BYTES // 2**20} MiB, the limit of a "
                          "config file: is it the right file?")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (some editors write one) skipped
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                          "a TOML file is UTF-8") from None


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device"
            if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")


def _key_lines(text: str) -> dict:
    """Key path -> the line that writes it (tables by their header), first one kept."""
    lines, table, in_string = {}, (), None
    for number, line in enumerate(text.splitlines(), 1):
        if in_string:
            if line.count(in_string) % 2:
                in_string = None
            continue
        header, key = _HEADER.match(line), _KEY.match(line)
        if header and not key:
            table = _parts(header.group(1).strip("[] "))
            lines.setdefault(table, number)
        elif key:
            lines.setdefault(table + _parts(key.group(1)), number)
            rest = line[key.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2:
                    in_string = quote
    return lines


def _parts(dotted: str) -> tuple[str, ...]:
    return tuple(p.strip().strip("\"'") for p in re.findall(r"""(?:"[^"]*"|'[^']*'|[^.]+)""", dotted))


def check_shape(tables: dict, source: ConfigFile | None = None, where: str = "the config") -> None:
    """Every table a section, every key one of its section's fields, every scheme option
    declared; refusals name the file and line (``source``) and where the key belongs."""
    def at(*path):
        return source.at(*path) if source is not None else where

    for name, table in tables.items():
        if name not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"{at(name)}: {_misplaced(name, table)}")
        known = {f.name for f in dataclasses.fields(SECTIONS[name])}
        for key in table:
            if key not in known:
                raise ConfigError(f"{at(name, key)}: [{name}] has no field {key}; "
                                  f"{_belongs(key, sorted(known))}")
        options = table.get("options", {})
        if name == "pipeline" and not isinstance(options, dict):
            raise ConfigError(f"{at(name, 'options')}: [pipeline] options must be a table of "
                              f"scheme options ([pipeline.options]), got {options!r}")
        unknown = [k for k in options if k not in option_declarations()]
        if unknown:
            raise ConfigError(f"{at(*OPTIONS, unknown[0])}: [pipeline.options] has no scheme "
                              f"option {unknown[0]}; declared: {', '.join(option_declarations())}")


def _misplaced(name: str, value) -> str:
    """What a top-level ``name = value`` that is not a section's table is, and where it goes."""
    tables = ", ".join(SECTIONS)
    if name in SECTIONS:  # `pipeline = "chimera"`: a section written as a key
        keys = [f.name for f in dataclasses.fields(SECTIONS[name]) if f.name != "options"]
        hint = _suggest_key(name, value) or f"its keys: {', '.join(keys)}"
        return (f"{name} = {_shown(value)} is a key at the top level, but {name} is a table: "
                f"write [{name}] and its keys under it ({hint})")
    if isinstance(value, dict):
        also = f" ({name} is a key of [{FLAT[name]}])" if name in FLAT else ""
        return f"unknown table [{name}]; the tables are {tables}{also}"
    if name in FLAT:
        return (f"{name} = {_shown(value)} is at the top level, outside any table: {name} is a "
                f"key of [{FLAT[name]}]: put it under [{FLAT[name]}]")
    if name in option_declarations():
        return (f"{name} = {_shown(value)} is at the top level: {name} is a scheme option: put it "
                "under [pipeline.options]")
    return f"unknown key {name} at the top level; the tables are {tables}"


def _shown(value) -> str:
    """``value`` as TOML writes a string, a number or a boolean."""
    return json.dumps(value) if isinstance(value, (str, bool, int, float)) else repr(value)


def _suggest_key(section: str, value) -> str | None:
    """`pipeline = "chimera"` most likely meant the scheme: say so."""
    if section == "pipeline" and isinstance(value, str) and \
            value in {"none", *(s.name for s in schemes())}:
        return f'schedule = "{value}"'
    return None


def _belongs(key: str, known: list[str]) -> str:
    """Where ``key`` belongs instead (another table, the scheme options), or a near name."""
    if key in FLAT:
        return f"{key} belongs under [{FLAT[key]}]"
    if key in option_declarations():
        return f"{key} is a scheme option: put it under [pipeline.options]"
    near = difflib.get_close_matches(key, known, n=1)
    return (f"did you mean {near[0]}? " if near else "") + f"it has {', '.join(known)}"


__all__ = ["ConfigFile", "MAX_BYTES", "read", "check_shape"]
