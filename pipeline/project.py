"""`smpipe init DIR`: a new project from the template, as `kedro new` or `cargo new` make one.

The template (pipeline/project_template/, shipped as package data) is a project that runs as it
is: settings.ini with every key commented, the five user functions, and a small sample. Nothing
of the user's is ever overwritten (`init_project`). The template's settings.ini is derived from
the demo's (`derive_settings`); `python -m pipeline.project` writes it again.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

from pipeline.config import NAME_RE

TEMPLATE = Path(__file__).with_name("project_template")
DEMO_SETTINGS = Path(__file__).resolve().parent.parent / "settings.ini"
# The template's experiment name, replaced by the project's own.
TEMPLATE_NAME = "my-project"
NAME_LINE = re.compile(r"^NAME = .*$", re.MULTILINE)
KEY_LINE = re.compile(r"^([A-Za-z0-9_:]+)\s*=\s*(.*)$")

HEADER = """\
# The settings of this project, made by `smpipe init`: MiniLM finetuned on the sample in
# data/news.csv (100 news items, 5 topics) on this machine, against a bag-of-embeddings
# baseline learned from scratch; `smpipe run settings.ini` runs both and compares them.
# Every key is listed with what it means and its default, except where a line "# sample: ..."
# just above the key says what the sample sets instead, why, and what to set for your own data.
# Keys are case-insensitive; an unknown key or section is an error.
# Any key can be overridden from the environment: SMPIPE__<SECTION>__<KEY>, dots in a section
# name written as '_': SMPIPE__TRAINING__EPOCHS=1,
# SMPIPE__TUNING_HYPERPARAMETERS__LEARNING_RATE=1e-5->1e-3.
"""
# (section, KEY) -> the sample's value and why ("": a required key, which has no default).
# Every other key is at its default: the demo's own values (`# demo:`) are not the sample's.
SAMPLE = {
    ("experiment", "NAME"): (TEMPLATE_NAME, ""),
    ("experiment", "STORE"): ("./artifacts", ""),
    ("data", "RAW_DATA"): (
        "data",
        "data (default empty): the sample beside this file. Point it at your own data, or "
        "leave it empty and `smpipe upload settings.ini FOLDER` once.",
    ),
    ("models", "MODEL_NAMES"): (
        "minilm, bow",
        "minilm, bow: the pretrained MiniLM against a bag of embeddings learned from scratch "
        "(user_functions), so the first run's report compares two models.",
    ),
    ("training", "LEARNING_RATE"): (
        "3e-4",
        "3e-4 (default 5e-5, the Trainer's): the sample's 15 steps need large ones; for your "
        "data start from the default.",
    ),
    ("training", "BATCH_SIZE"): (
        "16",
        "16 (default 32): 5 steps an epoch of the sample's 79 training rows; 32 for your data.",
    ),
    ("hub", "OFFLINE"): (
        "true",
        "true (default false): the sample's model is a pip package; false once a model is "
        "named by its Hub name in user_functions.",
    ),
}
# The demo's own words where the project's differ: (the demo's, the project's).
REWORDED = [
    (
        """\
# To tune instead of train, set [experiment] JOB = tune (or run it once as below); the ranges
# below make a try that finishes in two minutes here (112 s on 2 cores, 4 trials per model,
# some stopped early), the data steps reused from `make run`:
#   SMPIPE__EXPERIMENT__JOB=tune python run_pipeline.py settings.ini
""",
        """\
# To tune instead of train, set [experiment] JOB = tune, or run it once so:
#   SMPIPE__EXPERIMENT__JOB=tune smpipe run settings.ini
""",
    ),
]


class ProjectError(ValueError):
    """A project that cannot be created where it was asked for."""


def template_files() -> list[Path]:
    """The template's files, relative to it: what a new project holds."""
    return sorted(
        p.relative_to(TEMPLATE)
        for p in TEMPLATE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def project_name(folder: Path) -> str:
    """The experiment NAME for a project in `folder`: its name, made a valid NAME (letters,
    digits, '_' and '-'; the run tree's top folder and every job's name start with it)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", folder.resolve().name).strip("-_")[:63]
    return name if NAME_RE.match(name) else TEMPLATE_NAME


def check_folder(folder: Path) -> None:
    """A project starts in a new or empty folder: whatever is there is named, and refused.
    Hidden entries the template does not write are not the user's work in the way (`.git/` of
    a repository just cloned, `.DS_Store`, an editor's folder): they stay, as they are. A
    link on the way that leads nowhere (DIR itself or a folder above it) is named too: the
    folders cannot be made through it."""
    for path in (folder, *folder.parents):
        if path.is_symlink() and not path.exists():
            raise ProjectError(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist (or "
                f"loops): {folder} cannot be made through it; make what it points to, or "
                "choose another folder"
            )
    if folder.exists() and not folder.is_dir():
        raise ProjectError(f"{folder} is a file, not a folder")
    written = {relative.parts[0] for relative in template_files()}
    entries = sorted(
        entry_name(p)
        for p in (folder.iterdir() if folder.exists() else ())
        if not p.name.startswith(".") or p.name in written
    )
    if entries:
        raise ProjectError(
            f"{folder} is not empty ({', '.join(entries)}): a project starts in a new or "
            "empty folder, and nothing of yours is overwritten"
        )


def entry_name(path: Path) -> str:
    """An entry of a folder as the refusal lists it: folders with '/', dead links said so."""
    if path.is_symlink() and not path.exists():
        return f"{path.name} -> {os.readlink(path)}, a link to nothing"
    return path.name + "/" * path.is_dir()


def init_project(folder: Path) -> tuple[str, list[Path]]:
    """Create a project in `folder` (made if missing): the template's files, with the
    experiment NAME taken from the folder's name. Returns (NAME, the files created). A folder
    that holds anything is refused (`check_folder`), and each file is created exclusively. The
    user functions are written with transformers' Auto classes and `TODO` where a user's data
    differs."""
    check_folder(folder)
    name = project_name(folder)
    files = template_files()
    for relative in files:
        content = (TEMPLATE / relative).read_bytes()
        if relative == Path("settings.ini"):
            text, replaced = NAME_LINE.subn(f"NAME = {name}", content.decode("utf-8"), count=1)
            if replaced != 1:
                raise ProjectError(f"{TEMPLATE / relative} names no experiment (NAME = ...)")
            content = text.encode("utf-8")
        target = folder / relative
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError as e:  # a file or a dead link made since the check
            why = "something else is there"
            raise ProjectError(f"cannot create the folder {e.filename}: {why}") from None
        except OSError as e:
            raise ProjectError(f"cannot create the folder {e.filename}: {e.strerror}") from None
        try:
            with open(target, "xb") as f:  # never overwrites, even a file made since the check
                f.write(content)
        except FileExistsError:
            raise ProjectError(f"{target} appeared meanwhile; it was left as it is") from None
        except OSError as e:
            raise ProjectError(f"cannot create {target}: {e.strerror}") from None
    return name, files


def per_model(section: str) -> bool:
    """[training.<model>] and [tuning.hyperparameters.<model>] of a model the sample does not
    train: the demo's only."""
    model = section.rsplit(".", 1)[-1]
    sample = [m.strip() for m in SAMPLE["models", "MODEL_NAMES"][0].split(",")]
    return section.startswith(("training.", "tuning.hyperparameters.")) and model not in sample


def default_text(section: str, key: str) -> str:
    """A key's default as settings.ini writes it."""
    from pydantic_core import PydanticUndefined

    from pipeline.config import SECTIONS

    value = SECTIONS[section].model_fields[key.lower()].default
    if value is PydanticUndefined:
        raise ValueError(
            f"[{section}] {key.upper()}: the demo sets it and it has no default; "
            "pipeline/project.py SAMPLE must give the sample's value"
        )
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return str(value)


def derive_settings(demo: str) -> str:
    """The template's settings.ini from the demo's: the same keys with the same comments, each
    at its default; its header, per-model sections and `# demo:` values left out, the sample's
    values put in with a `# sample:` line saying why. A test holds the two equal."""
    for old, _ in REWORDED:
        if old not in demo:
            raise ValueError(f"settings.ini no longer says, as pipeline/project.py expects:\n{old}")
    for old, new in REWORDED:
        demo = demo.replace(old, new)
    lines, section, demo_value, applied = [], None, False, set()
    for line in demo.splitlines(keepends=True):
        stripped, key = line.strip(), KEY_LINE.match(line.strip())
        if stripped.startswith("["):
            section = stripped[1:-1].lower()
        if section is None or per_model(section):
            continue
        if stripped.startswith("# demo:"):
            demo_value = True
            continue
        if key and (section, key[1].upper()) in SAMPLE:
            value, why = SAMPLE[section, key[1].upper()]
            applied.add((section, key[1].upper()))
            if why:
                lines.append(
                    textwrap.fill(why, 96, initial_indent="# sample: ", subsequent_indent="# ")
                    + "\n"
                )
            line = f"{key[1]} = {value}\n"
        elif key and demo_value:
            line = f"{key[1]} = {default_text(section, key[1])}\n"
        demo_value = demo_value and not key
        lines.append(line)
    if set(SAMPLE) - applied:
        raise ValueError(f"settings.ini has no key {sorted(set(SAMPLE) - applied)} the sample sets")
    return HEADER + "\n" + "".join(lines).rstrip("\n") + "\n"


def main() -> None:
    """Write the template's settings.ini again from the demo's."""
    derived = derive_settings(DEMO_SETTINGS.read_text(encoding="utf-8"))
    (TEMPLATE / "settings.ini").write_text(derived, encoding="utf-8")
    print(f"wrote {TEMPLATE / 'settings.ini'} from {DEMO_SETTINGS}", file=sys.stderr)


if __name__ == "__main__":
    main()
