"""Upload a folder of raw data into an experiment's raw/ location in the store.

    python -m pipeline.stage settings.ini LOCAL_DIR [--if-empty]

Raw data is the user's: it is copied as it is. An experiment that already has raw data is
left alone with --if-empty, and refused without it, so staging never mixes two data sets.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.config import ConfigError, load_settings
from pipeline.paths import ExperimentTree
from pipeline.store import Store, open_store


def stage(store: Store, tree: ExperimentTree, local_dir: Path) -> int:
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    for path in files:
        store.upload_file(path, tree.raw + path.relative_to(local_dir).as_posix())
    return len(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings")
    parser.add_argument("local_dir", type=Path)
    parser.add_argument(
        "--if-empty", action="store_true", help="do nothing when raw data is already staged"
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.settings)
        store = open_store(settings.store_uri(), settings.experiment.region)
        unreachable = store.problems()
        if unreachable:
            raise ConfigError(unreachable, settings.source)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tree = ExperimentTree(settings.experiment.name)
    if store.list_keys(tree.raw):
        if args.if_empty:
            print(f"raw data already staged at {store.uri_of(tree.raw)}")
            return 0
        print(
            f"error: {store.uri_of(tree.raw)} already holds raw data; refusing to mix data sets",
            file=sys.stderr,
        )
        return 1
    count = stage(store, tree, args.local_dir)
    print(f"staged {count} files at {store.uri_of(tree.raw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
