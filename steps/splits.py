"""How prepare splits the reconciled rows into train, validation and test: stratified by label
(scikit-learn's train_test_split, as the Hugging Face and scikit-learn docs split), rows that
repeat what a model's encode reads of another row of their label kept in one split, and a
split that cannot be made said in one line."""

from __future__ import annotations

import argparse
import collections
import hashlib
import math

import datasets
import numpy as np
import pyarrow as pa
from sklearn.model_selection import train_test_split

# How many of the labels short of rows a failed split names; the rest are counted.
NAMED_LABELS = 5


def rows_a_label_needs(train: float, validation: float, test: float) -> int:
    """The fewest rows a label needs for `stratified_split` to put it in every split, from the
    rules scikit-learn's train_test_split(stratify=...) splits by (sklearn/model_selection/
    _split.py, StratifiedShuffleSplit._iter_indices): every class has 2 members at least ("The
    least populated classes in y have only 1 member"), the train and test sizes are each at
    least the number of classes ("The test_size = %d should be greater or equal to the number
    of classes = %d"), and each class gets its share of either size (_approximate_mode).
    Here the rows are split twice, train from validation and test together (their share,
    `held`), then validation from test: a label needs one row in train, two in the held part
    (the second split's least populated class), one in validation and one in test. A label
    of n rows gets about n times each fraction, so n is the largest of 1/train, 2/held,
    1/validation and 1/test, rounded up."""
    held = validation + test
    # The tolerance keeps 2 / 0.2 at 10 where floating point gives 10.000000000000002.
    return max(math.ceil(x - 1e-9) for x in (1 / train, 2 / held, 1 / validation, 1 / test))


def stratified_split(
    labels: list[int], id2label: dict[int, str], args: argparse.Namespace
) -> dict[str, np.ndarray]:
    indices = np.arange(len(labels))
    held_out = args.validation_fraction + args.test_fraction
    try:
        train, rest = train_test_split(
            indices, test_size=held_out, stratify=labels, random_state=args.seed
        )
        rest_labels = [labels[i] for i in rest]
        validation, test = train_test_split(
            rest,
            test_size=args.test_fraction / held_out,
            stratify=rest_labels,
            random_state=args.seed,
        )
    except ValueError as e:
        raise ValueError(cannot_split(labels, id2label, args, str(e))) from None
    return {"train": np.sort(train), "validation": np.sort(validation), "test": np.sort(test)}


def same_inputs(
    dataset: datasets.Dataset, models: list[list[str]], labels: list[int]
) -> np.ndarray | None:
    """Each row's group, numbered by first appearance; None where no two rows share one. Rows
    share a group where they hold the same in every column a model's encode reads (`models`:
    the columns of each) and the same label, whichever model; rows of one text and another
    label are not grouped, so that a label whose rows copy another label's texts still
    reaches every split. The columns as reconcile gave them, not as encoded: texts that
    differ only after MAX_SEQUENCE_LENGTH (a long common header) stay apart."""
    parent = np.arange(len(dataset))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    table, repeated = dataset.with_format("arrow"), False
    for columns in filter(None, models):  # a model whose encode reads no column: no text
        first: dict[tuple, int] = {}
        keys = zip(*(row_digests(table[c]) for c in columns), labels, strict=True)
        for row, key in enumerate(keys):
            earlier = first.setdefault(key, row)
            if earlier != row:  # joined to the earlier row's group: its root is the smaller
                a, b = root(earlier), root(row)
                parent[max(a, b)], repeated = min(a, b), True
    if not repeated:
        return None
    roots = np.array([root(i) for i in range(len(parent))])
    return np.unique(roots, return_inverse=True)[1].reshape(-1)  # roots: first rows, in order


def row_digests(column: pa.ChunkedArray) -> list[bytes]:
    """Each row's value of a column as a 16-byte digest (memory does not grow with the texts'
    lengths), a slice of rows at a time: a text, a list (pre-split words), a number."""
    keys: list[bytes] = []
    for chunk in column.chunks:
        for start in range(0, len(chunk), DIGESTED_ROWS):
            for value in chunk.slice(start, DIGESTED_ROWS).to_pylist():
                said = repr(value).encode("utf-8", "surrogatepass")
                keys.append(hashlib.blake2b(said, digest_size=16).digest())
    return keys


DIGESTED_ROWS = 10_000  # rows of a column in Python at once, while their digests are taken


def fractions_of(args: argparse.Namespace) -> tuple[float, float, float]:
    """TRAIN_FRACTION, VALIDATION_FRACTION and TEST_FRACTION, in the order of the splits."""
    return args.train_fraction, args.validation_fraction, args.test_fraction


def repeats_together(
    dataset: datasets.Dataset,
    models: list[list[str]],
    labels: list[int],
    id2label: dict[int, str],
    args: argparse.Namespace,
    splits: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """`splits`, or where rows repeat what a model's encode reads of another row of their label,
    the split that keeps each such group in one part (`grouped_split`), said; and where a
    large group pulls a part's size far from its fraction, that too."""
    groups = same_inputs(dataset, models, labels)
    if groups is None:
        return splits
    print(
        f"{len(groups) - groups.max() - 1} rows repeat, for their label, what a model's encode "
        "reads of another row: each such group is kept in one split, so that no validation or "
        "test row is a training row again (reconcile may drop the duplicates)"
    )
    grouped = grouped_split(labels, groups, id2label, args)
    asked = dict(zip(grouped, fractions_of(args), strict=True))
    if max(abs(len(rows) / len(groups) - asked[n]) for n, rows in grouped.items()) > 0.05:
        sizes = np.bincount(groups)
        biggest = int(sizes.argmax())
        row = int(np.flatnonzero(groups == biggest)[0])
        print(
            f"warning: the splits hold {', '.join(f'{n} {len(r)}' for n, r in grouped.items())} "
            f"rows, far from the fractions asked: a group of {sizes[biggest]} rows repeating "
            f"one input (row {row} and its copies) stays in one split; drop the copies in "
            "reconcile"
        )
    return grouped


def grouped_split(
    labels: list[int], groups: np.ndarray, id2label: dict[int, str], args: argparse.Namespace
) -> dict[str, np.ndarray]:
    """The stratified split of the groups (each of one label), every row going
    where its group went: a text in train and in test would score the model's memory of it.
    Stratified group splitting, as scikit-learn's StratifiedGroupKFold does for folds."""
    first = np.unique(groups, return_index=True)[1]  # group g's first row: first[g]
    try:
        chosen = stratified_split([labels[i] for i in first], id2label, args)
    except ValueError as e:
        raise ValueError(
            f"{e} (counting once the rows of one label whose text a model's encode reads is "
            "the same)"
        ) from None
    return {name: np.flatnonzero(np.isin(groups, picked)) for name, picked in chosen.items()}


def cannot_split(
    labels: list[int], id2label: dict[int, str], args: argparse.Namespace, why: str
) -> str:
    """Why the split failed, in one line: how many rows a label needs for these fractions,
    and the few labels short of it (the fewest rows first), with a count of the others."""
    need = rows_a_label_needs(args.train_fraction, args.validation_fraction, args.test_fraction)
    counts = collections.Counter(id2label[i] for i in labels)
    short = sorted((n, label) for label, n in counts.items() if n < need)
    named = {label: n for n, label in short[:NAMED_LABELS]}
    more = f" and {len(short) - len(named)} more" if len(short) > len(named) else ""
    fractions = f"{args.train_fraction:g}/{args.validation_fraction:g}/{args.test_fraction:g}"
    head = (
        f"cannot split {len(labels)} rows stratified by label into train/validation/test "
        f"{fractions}: a label needs at least {need} rows for these fractions (one in train, "
        "one in validation, one in test: two held out)"
    )
    if not short:  # every label has enough: the split failed on a total (scikit-learn says)
        return f"{head}; every label of {len(counts)} has them, but scikit-learn says: {why}"
    return (
        f"{head}; labels with too few rows {named}{more} ({len(short)} of {len(counts)} "
        "labels): add rows, merge or drop those labels, or raise VALIDATION_FRACTION and "
        "TEST_FRACTION"
    )
