"""Prepare (processing job): encode the snapshot for every model and split it.

Every model's columns are prefixed with its name (`minilm_input_ids`), so in a comparison
all models train and are tested on exactly the same rows. The split is stratified by label.

Inputs:  snapshot  the reconciled dataset
Outputs: train, validation, test  the splits (datasets save_to_disk)
         labels    id2label.json
         report    step_metadata.json
"""

from __future__ import annotations

import argparse
import json
import os

import datasets
import numpy as np
from sklearn.model_selection import train_test_split

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


def main() -> None:
    args = parse_args()
    functions = load_user_functions(os.environ["SMPIPE_USER_FUNCTIONS"])
    snapshot = datasets.load_from_disk(str(processing_input("snapshot") / "dataset"))
    model_names = [m for m in args.model_names.split(",") if m]

    id2label = dict(enumerate(sorted(set(snapshot["label"]))))
    label2id = {label: i for i, label in id2label.items()}
    dataset = snapshot.map(lambda b: {"label_id": [label2id[x] for x in b["label"]]}, batched=True)

    for model_name in model_names:
        tokenizer = call(functions, "load_tokenizer", model_name)

        def encode(batch, tokenizer=tokenizer, model_name=model_name):
            encoded = call(functions, "encode", batch, tokenizer, model_name, args.max_length)
            if not isinstance(encoded, dict) or not encoded:
                raise TypeError(
                    f"{functions.module}.encode must return a non-empty dict of columns"
                )
            return {f"{model_name}_{k}": v for k, v in encoded.items()}

        dataset = dataset.map(encode, batched=True, batch_size=256, desc=f"encode {model_name}")
        keys = call(functions, "ordered_input_keys", model_name)
        missing = [k for k in keys if f"{model_name}_{k}" not in dataset.column_names]
        if missing:
            raise ValueError(
                f"{functions.module}.ordered_input_keys({model_name!r}) names {missing}, "
                f"which {functions.module}.encode did not produce"
            )
        print(
            f"encoded {len(dataset)} rows for {model_name}: columns {[c for c in dataset.column_names if c.startswith(model_name + '_')]}"
        )

    splits = stratified_split(dataset["label_id"], args)
    sizes = {}
    for name, indices in splits.items():
        part = dataset.select(indices)
        part.save_to_disk(str(processing_output(name)))
        sizes[name] = len(part)
    (processing_output("labels") / "id2label.json").write_text(
        json.dumps({str(k): v for k, v in id2label.items()}, indent=2)
    )
    print(f"splits: {sizes}; labels: {id2label}")
    write_step_metadata(
        processing_output("report"),
        {
            "split_sizes": sizes,
            "id2label": id2label,
            "model_names": model_names,
            "max_length": args.max_length,
            "seed": args.seed,
        },
    )


if __name__ == "__main__":
    run_step("prepare", main)
