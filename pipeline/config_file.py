"""settings.ini as text: read, checked line by line, overridden from the environment, and
written back as applied with its secrets blanked. pipeline/config.py types what this reads.

configparser stops at a file's first error and silently reinterprets some lines; here every
line it would refuse is a problem of its own, with its number, so that `ConfigError` lists
them all at once.
"""

from __future__ import annotations

import configparser
import io
import re
from pathlib import Path

from pipeline.search_space import SECTION as HP

ENV_PREFIX = "SMPIPE__"
HP_ENV = HP.replace(".", "_") + "_"  # SMPIPE__TUNING_HYPERPARAMETERS_<MODEL>__<KEY>
SECRET_KEY_RE = re.compile(r"(key|secret|token|password)", re.IGNORECASE)


class ConfigError(ValueError):
    """Every problem of one settings file, each on its own line."""

    def __init__(self, problems: list[str], source: str = "settings"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


def read_text(path: Path) -> str:
    """The file's text; a UTF-8 byte order mark (Windows editors write one) is dropped."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise ConfigError([f"settings file not found: {path}"], str(path)) from None
    except IsADirectoryError:
        raise ConfigError(
            [f"{path} is a folder; name the settings .ini file in it"], str(path)
        ) from None
    except PermissionError:
        raise ConfigError(
            [f"settings file {path} cannot be read (permission denied)"], str(path)
        ) from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            [
                f"line {line}: not UTF-8 text (byte {e.object[e.start]:#04x}); "
                "save the file as UTF-8"
            ],
            str(path),
        ) from None


def lint_ini(text: str) -> tuple[list[str], str]:
    """Every line configparser would refuse or silently reinterpret, with its number, and
    the text without those lines (so the rest of the file is still checked).

    configparser stops at its first error and joins an indented line to the value above it
    (`EPOCHS = 2` then `  3` reads as "2\n3"); here each such line is a problem of its own."""
    problems: list[str] = []
    kept: list[str] = []
    keys: dict[str, set[str]] = {}  # section -> its keys so far
    section = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped, problem = line.strip(), None
        if not stripped or stripped[0] in "#;":
            kept.append(line)
            continue
        if stripped.startswith("["):
            name = stripped[1:-1].strip().lower() if stripped.endswith("]") else ""
            if not name:
                problem = f"{stripped!r} is not a [section] header"
            elif name in keys:
                problem = f"section [{name}] appears twice"
            section = name or None
            keys.setdefault(name, set())
        elif line[0].isspace():
            problem = (
                f"indented line {stripped!r} would continue the value above it; start it at "
                "the beginning of the line (or comment it out with #)"
            )
        elif "=" not in stripped:
            problem = f"{stripped!r} is not KEY = value"
        elif section is None:
            problem = f"{stripped!r} comes before any [section] header"
        else:
            key = stripped.split("=", 1)[0].strip().lower()
            if not key:
                problem = f"{stripped!r} has no key before '='"
            elif key in keys[section]:
                problem = f"[{section}] {key.upper()} is set twice"
            keys[section].add(key)
        if problem:
            problems.append(f"line {number}: {problem}")
        kept.append("" if problem else line)
    return problems, "\n".join(kept)


def ini_parser() -> configparser.ConfigParser:
    """How every settings.ini is read, a run's own included (its USER_FUNCTIONS, what changed
    since another run). A comment may follow a value after a space, "#" as the shipped file
    writes its comments or ";" (configparser takes an inline prefix only after whitespace):
    without "#", `STORE = ./artifacts  # mine` would name a folder "./artifacts  # mine"."""
    parser = configparser.ConfigParser(
        interpolation=None, delimiters=("=",), inline_comment_prefixes=("#", ";")
    )
    parser.optionxform = str.lower  # keys are case-insensitive; the file writes them in capitals
    return parser


def read_ini(path: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The sections and keys of the file, and every problem of its syntax."""
    problems, text = lint_ini(read_text(path))
    parser = ini_parser()
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as e:  # what the lint above did not foresee, still one line
        raise ConfigError([*problems, f"not a valid ini file: {e}"], str(path)) from None
    return {s.lower(): dict(parser.items(s)) for s in parser.sections()}, problems


def apply_env(
    raw: dict[str, dict[str, str]],
    env: dict[str, str],
    sections: list[str],
    applied: dict[tuple[str, str], str] | None = None,
) -> list[str]:
    """SMPIPE__<SECTION>__<KEY> overrides of `sections` (and of the per-model ones); one that
    names no section is refused, not ignored. The name in any case, as pydantic-settings reads
    an environment by default (`case_sensitive=False`): `smpipe__training__epochs` is no typo
    to ignore; two that set one key are refused. `applied` gets (section, key) -> the
    variable that set it, so a problem with it names the variable and the run says what it
    overrode."""
    names = {s.replace(".", "_"): s for s in sections}
    applied = {} if applied is None else applied
    problems = []
    for var, value in sorted(env.items()):
        if not var.upper().startswith(ENV_PREFIX):
            continue
        section, sep, key = var[len(ENV_PREFIX) :].lower().partition("__")
        if section in names:
            target = names[section]
        elif section.startswith("training_"):  # SMPIPE__TRAINING_<MODEL>__<KEY>
            target = "training." + section.removeprefix("training_")
        elif section.startswith(HP_ENV):  # SMPIPE__TUNING_HYPERPARAMETERS_<MODEL>__<KEY>
            target = HP + "." + section.removeprefix(HP_ENV)
        else:
            target = None
        if not sep or not key or not section:
            problems.append(f"environment {var}: write it as {ENV_PREFIX}<SECTION>__<KEY>")
        elif target and (target, key) in applied:
            problems.append(
                f"environment {applied[target, key]} and {var} both set [{target}] "
                f"{key.upper()}: unset one"
            )
        elif target:
            raw.setdefault(target, {})[key] = value
            applied[target, key] = var
        else:
            allowed = (
                ", ".join(n.upper() for n in names)
                + ", TRAINING_<MODEL>, TUNING_HYPERPARAMETERS_<MODEL>"
            )
            problems.append(f"environment {var}: no section {section.upper()} (allowed: {allowed})")
    return problems


def over_every_model(
    raw: dict[str, dict[str, str]], applied: dict[tuple[str, str], str]
) -> list[str]:
    """An override of [training] or [tuning.hyperparameters] KEY is the latest word for every
    model: the file's [training.<model>] KEY (or [tuning.hyperparameters.<model>] KEY) gives
    way to it too, unless a variable of its own sets that one. So the docs' example
    SMPIPE__TRAINING__EPOCHS=1 trains every model one epoch. Each value given way, said."""
    said = []
    for (section, key), var in sorted(applied.items()):
        if section not in ("training", HP):
            continue
        for each in sorted(s for s in raw if s.startswith(section + ".")):
            if key in raw[each] and (each, key) not in applied:
                value = raw[each].pop(key)
                applied[each, key] = var
                said.append(f"{var} overrides [{each}] {key.upper()} = {value} of the file too")
    return said


def render_redacted(raw: dict[str, dict[str, str]]) -> str:
    """The settings as they were applied (file + environment overrides), secrets blanked."""
    out = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    out.optionxform = str.upper
    for section, values in raw.items():
        out.add_section(section)
        for key, value in values.items():
            # An empty value hides nothing: it stays empty (it says "not set", not "a secret").
            masked = value and SECRET_KEY_RE.search(key)
            out.set(section, key, "<redacted>" if masked else value)
    buf = io.StringIO()
    out.write(buf)
    return buf.getvalue()
