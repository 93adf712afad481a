"""How the prepared data was encoded, recorded beside it: prepare writes it, training reads its
length from it, and the driver compares it with the settings before reusing the data.

    labels/encoding.json  {"max_length": 128,
                           "models": {"minilm": {"tokenizer": {"name_or_path", "class", "sha256"},
                                                 "reads": ["text", "n_words"],
                                                 "kinds": {"n_words": "int"}}}}

Light on imports: the driver reads it too.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

ENCODING = "encoding.json"  # in prepare's `labels` output, beside id2label.json


def encoding_record(max_length: int, models: dict[str, dict]) -> dict:
    """What encoding.json holds: the length rows were cut to, and for each model its tokenizer
    and the columns its encode reads (what predict asks of INPUT). A
    length belongs to the data it shaped (nanoGPT keeps block_size in its checkpoint): rows are
    cut once, by prepare, at `max_length` tokens ([data] MAX_SEQUENCE_LENGTH), and nothing after
    truncates them again."""
    return {
        "max_length": int(max_length),
        "models": models,
    }


def write_encoding(directory: Path, record: dict) -> None:
    (Path(directory) / ENCODING).write_text(json.dumps(record, indent=2))


def parse_encoding(text: str | bytes, where: str = ENCODING) -> dict:
    """encoding.json's record, its shape checked: ValueError naming `where` otherwise."""
    try:
        record = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where} is not JSON ({e}); run prepare again") from None
    length = record.get("max_length") if isinstance(record, dict) else None
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"{where} records no max_length (got {length!r}); run prepare again")
    return record


def recorded_reads(record: dict, model: str) -> list[str] | None:
    """The columns `model`'s encode reads, as prepare recorded them; None for data prepared
    before they were."""
    reads = ((record.get("models") or {}).get(model) or {}).get("reads")
    return list(reads) if isinstance(reads, list) else None


# What predict gives encode of a column that is not text, by the kind its values had in the
# run's data: whole numbers, numbers, true or false.
GIVEN_KINDS = ("int", "float", "bool")


def kind_of(dtype: str) -> str:
    """A column's kind, from its datasets dtype: text, int, float, bool, or the dtype itself
    (a list, say), which predict cannot give."""
    if dtype in ("string", "large_string", "string_view"):
        return "text"
    if dtype.startswith(("int", "uint")):
        return "int"
    if dtype.startswith(("float", "double", "half")):
        return "float"
    return "bool" if dtype == "bool" else dtype


def recorded_kinds(record: dict, model: str) -> dict[str, str]:
    """The columns `model`'s encode reads that are not text -> their kind (kind_of)."""
    return dict(((record.get("models") or {}).get(model) or {}).get("kinds") or {})


def as_kind(value, kind: str) -> tuple[object, str | None]:
    """(`value` as `kind`: int, float or bool, None for a blank; None) or (None, why not): a
    number in JSON or Parquet, or its text in CSV, "3", "3.0", "true"."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, None
    text = value.strip().lower() if isinstance(value, str) else None
    if kind == "bool":
        if isinstance(value, bool) or text in ("true", "false"):
            return (value if text is None else text == "true"), None
        return None, f"{value!r}, not true or false"
    try:
        number = float(text) if text is not None else value
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ValueError
    except ValueError:
        return None, f"{value!r}, not a number"
    if kind == "float":
        return float(number), None
    if float(number).is_integer():
        return int(number), None
    return None, f"{value!r}, not a whole number"


def read_encoding(directory: Path) -> dict:
    """The record prepare wrote in `directory` (its labels output, a job's labels channel)."""
    path = Path(directory) / ENCODING
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the prepared data predates the record of its encoding; "
            "run prepare again"
        )
    return parse_encoding(path.read_text(), str(path))


def tokenizer_identity(tokenizer) -> dict:
    """Which tokenizer encoded a model's rows: its name or path, its class, and a short hash of
    what decides its tokens (a fast tokenizer's definition without the truncation and padding
    that each call sets, else its vocabulary)."""
    kind = type(tokenizer)
    identity = {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or ""),
        "class": f"{kind.__module__}.{kind.__qualname__}",
    }
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            definition = fast_definition(backend)
        elif callable(getattr(tokenizer, "get_vocab", None)):
            definition = json.dumps(tokenizer.get_vocab(), sort_keys=True, default=str)
        else:
            return identity
    except Exception:  # noqa: BLE001 - the hash is a convenience; name and class remain
        return identity
    identity["sha256"] = hashlib.sha256(definition.encode()).hexdigest()[:16]
    return identity


def other_tokenizer(tokenizer, encoding: dict, model_name: str) -> str | None:
    """How `tokenizer` differs from the one that encoded the model's rows (encoding.json), or
    None: the same, or one of the two without a hash to compare."""
    recorded = ((encoding.get("models") or {}).get(model_name) or {}).get("tokenizer") or {}
    now, was = tokenizer_identity(tokenizer).get("sha256"), recorded.get("sha256")
    if not now or not was or now == was:
        return None
    return f"sha256 {now}, encoding.json records {was} for {recorded.get('name_or_path')!r}"


def fast_definition(backend) -> str:
    """A fast tokenizer's definition as the tokenizers library serializes it (vocabularies in
    id order), without the truncation and padding each call sets: those are lifted for the
    moment of serializing and put back. Re-serializing the JSON sorted instead costs 50 ms
    for a 30k vocabulary; this, 4 ms."""
    truncation, padding = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        return backend.to_str()
    finally:
        if truncation:
            backend.enable_truncation(**truncation)
        if padding:
            backend.enable_padding(**padding)


def capped(tokenizer, max_length: int):
    """The tokenizer as encode gets it: a copy whose `model_max_length` is MAX_SEQUENCE_LENGTH,
    so that the transformers tutorials' encode, `tokenizer(batch["text"], truncation=True)`
    (docs/transformers tasks/sequence_classification), truncates there and
    `padding="max_length"` pads there, as they do at `model_max_length` when given no
    `max_length` (tokenization_utils_base.py, `_get_padding_truncation_strategies`). A
    `max_length` encode passes still rules. A copy: the object load_tokenizer returned (which
    it may cache and share) is left as it was; a tokenizer without the attribute, or one that
    cannot be copied, is given as it is."""
    limit = getattr(tokenizer, "model_max_length", None)
    if not isinstance(limit, int) or limit <= max_length:
        return tokenizer
    try:
        own = copy.copy(tokenizer)
        own.model_max_length = max_length
    except Exception:  # noqa: BLE001 - a tokenizer of the user's own: encode gets it as it is
        return tokenizer
    return own
