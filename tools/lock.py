"""The locks `make install` and the image install from, made by uv from pyproject.toml.

    python tools/lock.py                          # `make lock`, after editing pyproject.toml
    python tools/lock.py --upgrade                # the newest releases the ranges admit
    python tools/lock.py --upgrade-package boto3  # one package only

requirements.lock holds [project].dependencies and everything they need; requirements-dev.lock
adds the dev extra, constrained by the first so both agree on every package they share. Each
line is an exact version with the hash of every file of that release (`--generate-hashes`), so
pip installs nothing else (https://pip.pypa.io/en/stable/topics/secure-installs/). uv keeps the
versions a lock already holds unless told to upgrade
(https://docs.astral.sh/uv/pip/compile/#upgrading-requirements); the arguments given here go to
every `uv pip compile` call. Behind a TLS-intercepting proxy uv needs its CA: SSL_CERT_FILE, or
`--native-tls` (https://docs.astral.sh/uv/concepts/authentication/certificates/).

torch is left out (tools/lock-excludes.txt says why); each lock is then resolved again with each
torch release the project runs on pinned and the lock as constraints, so a lock that cannot
install beside one of them fails here, with uv's account of the conflict.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_LOCK = "requirements.lock"
DEV_LOCK = "requirements-dev.lock"
EXCLUDES = "tools/lock-excludes.txt"
# Markers such as `python_version < "3.12"` are decided for this Python: the venv's and the
# image's. Each locked release still carries the hashes of all its files, for any Python.
# The real base's Python is the one pytorch's Dockerfile installs, `ARG PYTHON_VERSION=3.11`
# (github.com/pytorch/pytorch, Dockerfile; the 2.5.1 image was seen with 3.11.10); the stand-in
# base's is Debian bookworm's 3.11. tests/test_image.py reads the image's own.
PYTHON_VERSION = "3.11"
# The venv's torch (the CPU build `make install` puts in first) and the real base image's
# (pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime, docker/Dockerfile).
TORCH_RELEASES = ("2.13.0", "2.9.1")


def uv_compile(args: list[str], stdin: str | None = None) -> str:
    """Runs `uv pip compile pyproject.toml ARGS` in the repository; exits with uv's error."""
    command = [sys.executable, "-m", "uv", "pip", "compile", "pyproject.toml", *args]
    done = subprocess.run(command, cwd=ROOT, input=stdin, text=True, capture_output=True)
    if done.returncode != 0:
        shown = " ".join(["uv", *command[3:]])
        sys.exit(f"tools/lock.py: `{shown}` failed:\n{done.stderr}")
    return done.stdout


def write_locks(extra_args: list[str]) -> None:
    common = ["--generate-hashes", "--python-version", PYTHON_VERSION, "--excludes", EXCLUDES]
    uv_compile([*common, "-o", RUNTIME_LOCK, *extra_args])
    uv_compile(["--extra", "dev", *common, "-c", RUNTIME_LOCK, "-o", DEV_LOCK, *extra_args])


def check_torch(lock: str, extra_args: list[str]) -> None:
    """Resolves the lock's requirements with each torch release pinned and the lock as
    constraints: a locked version that cannot stand beside that torch fails the resolution."""
    extra = ["--extra", "dev"] if lock == DEV_LOCK else []
    for release in TORCH_RELEASES:
        quiet = ["--python-version", PYTHON_VERSION, "--no-header", "--no-annotate", "--quiet"]
        uv_compile([*extra, "-", "-c", lock, *quiet, *extra_args], stdin=f"torch=={release}\n")
        print(f"{lock}: installs beside torch {release}")


def main() -> None:
    extra_args = sys.argv[1:]
    write_locks(extra_args)
    for lock in (RUNTIME_LOCK, DEV_LOCK):
        check_torch(lock, extra_args)


if __name__ == "__main__":
    main()
