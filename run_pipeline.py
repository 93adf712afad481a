"""python run_pipeline.py settings.ini [options]: the same as `smpipe run settings.ini [options]`
(`smpipe --help` lists the other commands: plan, runs, compare, report, upload)."""

from __future__ import annotations

import sys

from pipeline import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
