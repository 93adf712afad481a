"""Prepare (processing job): encode the snapshot for every model and split it.

Every model's columns are prefixed with its name (`minilm_input_ids`), so in a comparison
all models train and are tested on exactly the same rows. The split is stratified by label.

Inputs:  snapshot  the reconciled dataset
Outputs: train, validation, test  the splits (datasets save_to_disk), with each model's
                   `<model>__length` (tokens per row, padding excluded)
         labels    id2label.json; inputs.json (per model: input keys, padding values)
         report    step_metadata.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import datasets
import numpy as np
from sklearn.model_selection import train_test_split

from steps.batching import check_encoded, length_column, pad_value, write_inputs
from steps.contract import processing_input, processing_output, run_step, write_step_metadata
from steps.user_code import call, load_user_functions


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-names", required=True)
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--train-fraction", type=float, required=True)
    parser.add_argument("--validation-fraction", type=float, required=True)
    parser.add_argument("--test-fraction", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    return parser.parse_args()


def stratified_split(labels: list[int], args: argparse.Namespace) -> dict[str, np.ndarray]:
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
        raise ValueError(
            f"cannot split {len(labels)} rows stratified by label with these fractions: {e}"
        ) from e
    return {"train": np.sort(train), "validation": np.sort(validation), "test": np.sort(test)}


def encode_for(dataset: datasets.Dataset, functions, model_name: str, max_length: int):
    """The user's encode over every row, in batches, checked; the model's columns prefixed with
    its name plus `<model>__length`, and what training needs to pad them (keys, padding values)."""
    tokenizer = call(functions, "load_tokenizer", model_name)
    keys = list(call(functions, "ordered_input_keys", model_name))
    where = f"{functions.module}.encode (model {model_name!r})"
    dropped: set[str] = set()

    def encode(batch):
        encoded = call(functions, "encode", batch, tokenizer, model_name, max_length)
        columns, extra, lengths = check_encoded(encoded, len(batch["label_id"]), keys, where)
        dropped.update(extra)
        return {
            **{f"{model_name}_{k}": v for k, v in columns.items()},
            length_column(model_name): lengths,
        }

    # A fingerprint of our own: datasets would otherwise pickle the closure (tokenizer and all)
    # to hash it, a third of the whole encode on the demo. Never read from a cache: the user's
    # encode may have changed under the same name.
    fingerprint = hashlib.sha256(
        f"{dataset._fingerprint}/{functions.module}/{model_name}/{max_length}".encode()
    ).hexdigest()[:16]
    dataset = dataset.map(encode, batched=True, batch_size=1000, desc=f"encode {model_name}",
                          new_fingerprint=fingerprint, load_from_cache_file=False,
                          keep_in_memory=True)  # fmt: skip
    info = {
        "keys": keys,
        "pad": {k: pad_value(k, tokenizer) for k in keys},
        # Sequences are padded per batch; scalar inputs (a feature per row) are stacked.
        "sequence": [
            k for k in keys if not isinstance(dataset.features[f"{model_name}_{k}"], datasets.Value)
        ],
    }
    lengths = np.asarray(dataset[length_column(model_name)])
    print(
        f"encoded {len(dataset)} rows for {model_name}: inputs {keys}, "
        f"length min {lengths.min()} median {int(np.median(lengths))} max {lengths.max()}"
    )
    if dropped:
        print(f"{where}: columns {sorted(dropped)} dropped (ordered_input_keys does not name them)")
    if lengths.max() > max_length:
        raise ValueError(
            f"{where} returned rows of up to {lengths.max()} tokens; MAX_SEQUENCE_LENGTH is "
            f"{max_length} (pass truncation=True, max_length=max_length to the tokenizer)"
        )
    return dataset, info


def main() -> None:
    args = parse_args()
    functions = load_user_functions(os.environ["SMPIPE_USER_FUNCTIONS"])
    snapshot = datasets.load_from_disk(str(processing_input("snapshot") / "dataset"))
    model_names = [m for m in args.model_names.split(",") if m]

    id2label = dict(enumerate(sorted(set(snapshot["label"]))))
    label2id = {label: i for i, label in id2label.items()}
    dataset = snapshot.map(lambda b: {"label_id": [label2id[x] for x in b["label"]]}, batched=True)

    inputs: dict[str, dict] = {}
    for model_name in model_names:
        dataset, inputs[model_name] = encode_for(dataset, functions, model_name, args.max_length)

    splits = stratified_split(dataset["label_id"], args)
    sizes = {}
    for name, indices in splits.items():
        part = dataset.select(indices)
        part.save_to_disk(str(processing_output(name)))
        sizes[name] = len(part)
    (processing_output("labels") / "id2label.json").write_text(
        json.dumps({str(k): v for k, v in id2label.items()}, indent=2)
    )
    write_inputs(processing_output("labels"), inputs)
    print(f"splits: {sizes}; labels: {id2label}")
    write_step_metadata(
        processing_output("report"),
        {
            "split_sizes": sizes,
            "id2label": id2label,
            "model_names": model_names,
            "max_length": args.max_length,
            "inputs": inputs,
            "seed": args.seed,
        },
    )


if __name__ == "__main__":
    run_step("prepare", main)
