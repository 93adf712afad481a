"""The five user functions: checked by name before any job starts, and nothing outside
user_functions/ knows about the demo's data."""

from __future__ import annotations

import io
import json
import random
import re
import sys
import textwrap

import pytest

from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.store import LocalStore
from steps.user_code import UserFunctionError, load_user_functions
from tests.conftest import ROOT, write_settings

# Another task entirely: reviews in one JSON-lines file, a 'review' text field, three labels,
# a hashing tokenizer, and a model whose inputs are called token_ids and mask.
REVIEWS = textwrap.dedent("""
    import json
    import zlib
    from pathlib import Path

    import datasets
    import torch
    from torch import nn

    def reconcile(raw_dir):
        rows = [json.loads(line) for line in (Path(raw_dir) / "reviews.jsonl").read_text().splitlines() if line.strip()]
        kept = [r for r in rows if r.get("stars") is not None]
        label = lambda s: "negative" if s <= 2 else "neutral" if s == 3 else "positive"
        data = datasets.Dataset.from_dict({"id": [r["id"] for r in kept], "review": [r["review"] for r in kept],
                                           "label": [label(r["stars"]) for r in kept]})
        return data, {"no_stars": [r["id"] for r in rows if r.get("stars") is None]}

    def load_tokenizer(model_name):
        return lambda text: [1 + zlib.crc32(w.encode()) % 4095 for w in text.lower().split()]

    def encode(batch, tokenizer, model_name, max_length):
        ids = [tokenizer(t)[:max_length] for t in batch["review"]]
        return {"token_ids": [x + [0] * (max_length - len(x)) for x in ids],
                "mask": [[1] * len(x) + [0] * (max_length - len(x)) for x in ids]}

    class Tiny(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.emb = nn.EmbeddingBag(4096, 16, mode="sum")
            self.out = nn.Linear(16, n)

        def forward(self, token_ids, mask):
            return self.out(self.emb(token_ids, per_sample_weights=mask.float()))

    def load_model(model_name, id2label, label2id):
        return Tiny(len(id2label))

    def ordered_input_keys(model_name):
        return ["token_ids", "mask"]
""")


def write_module(folder, name, source):
    (folder / f"{name}.py").write_text(source)
    sys.modules.pop(name, None)
    return name


def signed(source: str, **signatures: str) -> str:
    """`source` with each named function's parameters written as given."""
    for name, parameters in signatures.items():
        pattern = rf"^(\s*)def {name}\(.*\):$"
        source, found = re.subn(
            pattern, rf"\1def {name}({parameters}):", source, count=1, flags=re.M
        )
        assert found, name
    return source


def test_missing_and_misshapen_functions_are_named(tmp_path):
    broken = REVIEWS.replace("def ordered_input_keys(model_name):", "def input_keys(model_name):")
    broken = signed(broken, encode="batch, tokenizer")
    name = write_module(tmp_path, "broken_functions", broken)
    with pytest.raises(UserFunctionError) as info:
        load_user_functions(name, str(tmp_path))
    message = str(info.value)
    assert (
        "'broken_functions.encode' has the wrong signature encode(batch, tokenizer): expected encode(batch, tokenizer, model_name, max_length)"
        in message
    )
    assert "Module 'broken_functions' has no attribute 'ordered_input_keys'" in message
    with pytest.raises(UserFunctionError, match="Could not import module 'no_such_module'"):
        load_user_functions("no_such_module", str(tmp_path))


def test_functions_with_defaults_or_star_args_are_accepted_since_the_steps_pass_every_argument(
    tmp_path,
):
    """The steps call each function with all of the contract's arguments, by position
    (steps/user_code.py `call`): parameters after them with defaults, and *args/**kwargs, fit."""
    source = signed(
        REVIEWS,
        encode="batch, tokenizer, model_name, max_length=128, *, lower=True",
        load_model="model_name, id2label=None, label2id=None, **options",
        load_tokenizer="*args",
        reconcile="raw_dir, /, extra=None",
    )
    name = write_module(tmp_path, "defaults_functions", source)
    functions = load_user_functions(name, str(tmp_path))
    assert functions.encode.__defaults__ == (128,)


def test_every_signature_the_steps_cannot_call_is_refused_quoted_as_written(tmp_path):
    """One error lists them all, each quoted as Python prints it (its defaults too); a swap of
    names would be called without error, and is refused as well."""
    source = signed(
        REVIEWS,
        encode="batch, tokenizer, model_name, max_length=128, extra=None, *, strict",
        load_model="model_name, label2id, id2label=None",
        reconcile="**folders",
        # *args takes every argument: model_name, keyword-only after it, would stay None.
        load_tokenizer="*args, model_name=None",
    )
    name = write_module(tmp_path, "refused_functions", source)
    with pytest.raises(UserFunctionError) as info:
        load_user_functions(name, str(tmp_path))
    message = str(info.value)
    assert "4 problem(s)" in message
    assert (
        "'refused_functions.load_tokenizer' has the wrong signature "
        "load_tokenizer(*args, model_name=None): expected load_tokenizer(model_name)"
    ) in message
    assert (
        "'refused_functions.encode' has the wrong signature "
        "encode(batch, tokenizer, model_name, max_length=128, extra=None, *, strict): "
        "expected encode(batch, tokenizer, model_name, max_length) (called with these "
        "arguments, by position; a parameter after them needs a default)"
    ) in message
    assert (
        "'refused_functions.load_model' has the wrong signature "
        "load_model(model_name, label2id, id2label=None): "
        "expected load_model(model_name, id2label, label2id)"
    ) in message
    assert (
        "'refused_functions.reconcile' has the wrong signature reconcile(**folders): "
        "expected reconcile(raw_dir)"
    ) in message


def reviews_run(tmp_path, module: str, models: str = "tiny"):
    """The settings and store of a small run of the reviews task (experiment `reviews`) on
    tmp_path/raw, with the user functions of `module` (written by the caller)."""
    path = write_settings(
        tmp_path / "s.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": module, "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12"},
        models={"MODEL_NAMES": models},
    )  # fmt: skip
    settings = load_settings(path, {})
    return settings, LocalStore(settings.store_uri())


def write_reviews(raw, n=90, seed=3):
    rng = random.Random(seed)
    words = {
        1: ["awful", "broken", "refund"],
        3: ["okay", "average", "fine"],
        5: ["great", "love", "excellent"],
    }
    filler = ["the", "product", "arrived", "it", "is", "was", "and", "box"]
    raw.mkdir(parents=True)
    with open(raw / "reviews.jsonl", "w") as f:
        for i in range(n):
            stars = [1, 3, 5][i % 3]
            text = " ".join(rng.sample(filler, 4) + rng.sample(words[stars], 2))
            f.write(json.dumps({"id": f"r{i}", "review": text, "stars": stars}) + "\n")
        f.write(json.dumps({"id": "r-bad", "review": "no rating", "stars": None}) + "\n")


def test_another_task_runs_through_the_same_pipeline(tmp_path):
    write_module(tmp_path, "reviews_functions", REVIEWS)
    write_reviews(tmp_path / "raw")
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "reviews_functions", "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12"}, models={"MODEL_NAMES": "tiny"},
        training={"EPOCHS": "3", "LEARNING_RATE": "0.05"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    record = run_pipeline(
        settings, LocalStore(settings.store_uri()), parse_steps(None), echo=sys.stdout
    )
    assert record["status"] == "completed"
    assert record["steps"]["reconcile"]["details"]["dropped"] == {"no_stars": 1}
    assert record["steps"]["prepare"]["details"]["id2label"] == {
        "0": "negative",
        "1": "neutral",
        "2": "positive",
    }
    assert record["holdout_performance"]["tiny"]["rows"] == 9
    assert record["holdout_performance"]["tiny"]["accuracy"] > 0.5  # the words give the label away


def test_a_user_function_that_raises_fails_its_step_by_name(tmp_path):
    write_module(tmp_path, "raising_functions", REVIEWS.replace(
        "    ids = [tokenizer(t)[:max_length]", "    raise KeyError('review_text')\n    ids = [tokenizer(t)[:max_length]"))  # fmt: skip
    write_reviews(tmp_path / "raw")
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "raising_functions", "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw")}, models={"MODEL_NAMES": "tiny"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    with pytest.raises(PipelineError) as info:
        run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    message = str(info.value)
    assert "step 'prepare' failed" in message
    assert "user function raising_functions.encode raised KeyError: 'review_text'" in message
    record = json.loads(store.get_bytes("reviews/runs/0001/metadata.json"))
    assert record["status"] == "failed" and record["steps"]["prepare"]["status"] == "failed"
    assert "train" not in record["steps"] and record["model_artifacts"] == {}
    assert not store.list_keys("reviews/data/0001/prepared/")  # nothing promoted


def test_a_user_functions_error_names_the_error_it_was_raised_from_in_one_bounded_line():
    """Raised while handling another (no `from`): that one is named; `from None` hides it; a
    long message is cut so the cause still fits the job's 1,024-character message."""
    from steps.user_code import UserFunctions, call

    def lookup(raw_dir):
        try:
            {}["text"]
        except KeyError:
            if raw_dir == "hidden":
                raise ValueError("no text column") from None
            raise ValueError("no text column")  # noqa: B904 - the implicit chain is the case

    def long(raw_dir):
        try:
            raise OSError("disk\nfull " + "x" * 2000)
        except OSError as e:
            raise ValueError("a\nlong " + "y" * 2000) from e

    def functions(reconcile):
        return UserFunctions("mine", reconcile, *[None] * 4)

    with pytest.raises(RuntimeError) as info:
        call(functions(lookup), "reconcile", "raw")
    said = "user function mine.reconcile raised ValueError: no text column"
    assert str(info.value) == f"{said} (caused by KeyError: 'text')"
    with pytest.raises(RuntimeError) as info:
        call(functions(lookup), "reconcile", "hidden")
    assert str(info.value) == said
    with pytest.raises(RuntimeError) as info:
        call(functions(long), "reconcile", "raw")
    message = str(info.value)
    assert len(message) < 800 and "\n" not in message
    assert "raised ValueError: a long yyy" in message
    assert "y... (caused by OSError: disk full xxx" in message and message.endswith("x...)")


def test_a_module_this_machine_imports_but_no_run_ships_is_refused_naming_both_places(
    tmp_path, monkeypatch
):
    """USER_FUNCTIONS importable here through PYTHONPATH, but not beside the settings file: the
    jobs would not get it. Refused before any job, saying where the driver found it and where
    a run takes its code from."""
    from pipeline.user_check import check_user_functions

    elsewhere = tmp_path / "lib"
    elsewhere.mkdir()
    write_module(elsewhere, "mymodels", REVIEWS)
    monkeypatch.syspath_prepend(str(elsewhere))
    project = tmp_path / "project"
    project.mkdir()
    settings = load_settings(
        write_settings(project / "settings.ini", str(tmp_path / "store"),
                       experiment={"USER_FUNCTIONS": "mymodels"}),
        env={},
    )  # fmt: skip
    with pytest.raises(UserFunctionError) as raised:
        check_user_functions(settings)
    said = str(raised.value)
    assert f"no mymodels.py or mymodels/ beside the settings file ({project})" in said
    assert (
        f"this machine imports it from {elsewhere / 'mymodels.py'}, which no job receives" in said
    )
    write_module(project, "mymodels", REVIEWS)  # beside it: shipped, and checked as before
    assert check_user_functions(settings)


def test_a_model_name_load_model_does_not_know_is_refused_before_any_job(tmp_path):
    """MODEL_NAMES names a model load_model has no branch for: said before any job, naming the
    model, not in that model's training job after the others trained (on SageMaker, after a
    paid GPU job). Every model is built once, on the meta device, by the driver's check."""
    write_module(tmp_path, "one_model_functions", REVIEWS.replace(
        "    return Tiny(len(id2label))",
        "    if model_name == 'tiny':\n        return Tiny(len(id2label))"))  # fmt: skip
    write_reviews(tmp_path / "raw")
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "one_model_functions", "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw")}, models={"MODEL_NAMES": "tiny, other"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    with pytest.raises(UserFunctionError) as info:
        run_pipeline(settings, LocalStore(settings.store_uri()), parse_steps(None), echo=sys.stdout)
    said = str(info.value)
    assert "one_model_functions.load_model('other', ...) must return a torch.nn.Module" in said
    assert "got NoneType (MODEL_NAMES names 'other')" in said and "'tiny'" not in said
    assert not (tmp_path / "store").exists()


def test_a_relative_path_in_load_model_fails_in_the_check_as_it_would_in_the_job(
    tmp_path, monkeypatch
):
    """`from_pretrained("./my_model")`, run from the project's folder: every job runs in a
    folder of its own, where that path is not the project's, and so does the check, so the run
    is refused before any job (not in prepare, after reconcile ran), naming load_model."""
    write_module(tmp_path, "relative_functions", REVIEWS.replace(
        "    return Tiny(len(id2label))",
        "    assert Path('my_model').is_dir(), 'no ./my_model here'\n    return Tiny(len(id2label))"))  # fmt: skip
    (tmp_path / "my_model").mkdir()
    write_reviews(tmp_path / "raw")
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "relative_functions", "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw")}, models={"MODEL_NAMES": "tiny"},
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the user's shell, in the project's folder
    settings = load_settings(path, env={})
    with pytest.raises(UserFunctionError) as info:
        run_pipeline(settings, LocalStore(settings.store_uri()), parse_steps(None), echo=sys.stdout)
    said = str(info.value)
    assert "relative_functions.load_model('tiny', ...) on the meta device raised" in said, said
    assert "no ./my_model here" in said
    assert not (tmp_path / "store").exists()


def test_the_positions_a_model_embeds_are_read_from_its_position_table():
    """Learned absolute positions: BERT's table as it is, RoBERTa's less the padding index its
    positions start past, GPT-2's `wpe`, BART's less its offset; none for rotary positions."""
    import transformers
    from accelerate import init_empty_weights

    from steps.finetuning import positions_embedded

    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 64}  # fmt: skip
    built = {
        "bert": transformers.BertConfig(**small),
        "roberta": transformers.RobertaConfig(**small, max_position_embeddings=514),
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2),
        "bart": transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                        encoder_attention_heads=2, decoder_attention_heads=2),
        "llama": transformers.LlamaConfig(**small, num_key_value_heads=2),
    }  # fmt: skip
    found = {}
    for name, config in built.items():
        with init_empty_weights():
            model = transformers.AutoModelForSequenceClassification.from_config(config)
        found[name] = positions_embedded(model)
    assert found["bert"] == (512, "bert.embeddings.position_embeddings")
    assert found["roberta"] == (512, "roberta.embeddings.position_embeddings")
    assert found["gpt2"] == (1024, "transformer.wpe")
    assert found["bart"][0] == 1024 and found["bart"][1].endswith("embed_positions")
    assert found["llama"] is None


def test_a_max_sequence_length_past_the_models_positions_is_refused_before_any_job():
    """MAX_SEQUENCE_LENGTH above the positions MiniLM embeds (512) would pass prepare and fail
    in the training job's first forward pass: said by the model check, naming the key, the
    model, load_model and the most it takes; the bag of embeddings takes any length."""
    from steps.finetuning import check_models
    from steps.hyperparameters import DEFAULTS, MODEL_SETTINGS

    functions = load_user_functions("user_functions")
    hp = {key: value for key, value in DEFAULTS.items() if key in MODEL_SETTINGS}
    problems = check_models(functions, {name: {**hp, "max_sequence_length": 1024}
                                        for name in ("minilm", "bow")})  # fmt: skip
    assert problems == [
        "[data] MAX_SEQUENCE_LENGTH = 1024: model 'minilm' (user_functions.load_model) embeds at "
        "most 512 positions (bert.embeddings.position_embeddings), and a longer row would fail "
        "its forward pass: set 512 or less"
    ]
    assert check_models(functions, {"minilm": {**hp, "max_sequence_length": 512}}) == []


NAMED_OTHERWISE = """
import torch

from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401


class Classifier(torch.nn.Module):
    def __init__(self, labels):
        super().__init__()
        self.embedding, self.out = torch.nn.Embedding(30522, 8), torch.nn.Linear(8, labels)

    def forward(self, ids, mask):  # not ordered_input_keys' names
        return {"logits": self.out(self.embedding(ids).mean(1))}


class Open(Classifier):
    def forward(self, **inputs):
        return {"logits": self.out(self.embedding(inputs["input_ids"]).mean(1))}


def load_model(model_name, id2label, label2id):
    return (Classifier if model_name == "named" else Open)(len(id2label))
"""


def test_a_forward_that_cannot_take_the_inputs_by_name_is_refused_before_any_job(
    tmp_path, monkeypatch
):
    """Training calls forward(**inputs) with ordered_input_keys' names: a forward whose
    arguments are named otherwise is said by the model check of a run that trains, naming the
    model, load_model's class and the keys; one that takes **inputs passes."""
    from steps.finetuning import check_models
    from steps.hyperparameters import DEFAULTS, MODEL_SETTINGS

    write_module(tmp_path, "named_otherwise", NAMED_OTHERWISE)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = load_user_functions("named_otherwise")
    hp = {key: value for key, value in DEFAULTS.items() if key in MODEL_SETTINGS}
    assert check_models(functions, {"named": hp, "open": hp}) == [
        "model 'named': named_otherwise.load_model's Classifier.forward() takes no argument "
        "named 'input_ids', 'attention_mask', which ordered_input_keys names: training calls "
        "forward with each input by that name"
    ]
    # A run of data steps alone trains nothing: a stand-in model serves it.
    assert check_models(functions, {"named": {**hp, "trains": False}}) == []


BARE_KEYS = """
import user_functions
from user_functions import encode, load_tokenizer, reconcile  # noqa: F401


def load_model(model_name, id2label, label2id):
    return user_functions.load_model("bow", id2label, label2id)


def ordered_input_keys(model_name):
    return {"bare": "input_ids", "twice": ("input_ids", "input_ids"), "none": []}[model_name]
"""


def test_input_keys_that_are_not_a_list_of_names_are_refused_naming_the_function(
    tmp_path, monkeypatch
):
    """A bare string (which list() would read a character a key), a name twice or no name:
    said by the model check, naming ordered_input_keys, the model and what it returned; the
    same check holds prepare and training (steps/user_code.py `input_keys`)."""
    from steps.finetuning import check_models
    from steps.hyperparameters import DEFAULTS, MODEL_SETTINGS
    from steps.user_code import input_keys

    write_module(tmp_path, "bare_keys", BARE_KEYS)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = load_user_functions("bare_keys")
    hp = {key: value for key, value in DEFAULTS.items() if key in MODEL_SETTINGS}
    assert check_models(functions, {"bare": hp, "twice": hp, "none": hp}) == [
        "model 'bare': bare_keys.ordered_input_keys('bare') returned 'input_ids': it returns "
        "the list of forward()'s input names, such as ['input_ids', 'attention_mask']",
        "model 'twice': bare_keys.ordered_input_keys('twice') returned ['input_ids', "
        "'input_ids']: each name once, as a string",
        "model 'none': bare_keys.ordered_input_keys('none') returned []: it returns the list "
        "of forward()'s input names, such as ['input_ids', 'attention_mask']",
    ]
    with pytest.raises(ValueError, match=r"ordered_input_keys\('bare'\) returned 'input_ids'"):
        input_keys(functions, "bare")


def test_the_driver_holds_a_run_that_trains_to_what_training_asks_and_no_other(
    tmp_path, monkeypatch, demo_raw
):
    """Through the driver: a run that trains is refused before any job for a forward that
    cannot take the inputs by name; a run of the data steps alone is not."""
    write_module(tmp_path, "named_otherwise", NAMED_OTHERWISE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "named_otherwise"}, data={"RAW_DATA": str(demo_raw)},
        models={"MODEL_NAMES": "named"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    with pytest.raises(UserFunctionError, match=r"Classifier.forward\(\) takes no argument"):
        run_pipeline(settings, store, parse_steps(None), dry_run=True, echo=io.StringIO())
    run_pipeline(
        settings, store, parse_steps("reconcile,prepare"), dry_run=True, echo=io.StringIO()
    )


def test_a_forward_that_returns_a_dict_of_logits_is_read_as_a_model_output_is():
    """A dict with "logits", as a transformers ModelOutput is also read; anything else is
    refused naming what forward returned and what it may return."""
    import torch

    from steps.export import logits_of

    logits = torch.ones(2, 3)
    assert logits_of({"logits": logits, "hidden": None}) is logits
    assert logits_of((logits,)) is logits
    with pytest.raises(TypeError, match=r"returned dict from forward\(\); expected the logits"):
        logits_of({"scores": logits})


def test_the_demos_functions_taken_for_a_project_without_its_own_are_said(tmp_path):
    """A settings.ini copied where no user_functions/ is runs smpipe's own demo functions: said,
    with where they come from; a project's own module beside its settings is not."""
    from pipeline.user_check import demo_in_use

    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    said = demo_in_use(load_settings(path, env={}))
    assert said and f"is not beside {path}" in said and str(ROOT / "user_functions") in said
    write_module(tmp_path, "mine", REVIEWS)
    path = write_settings(path, str(tmp_path / "store"), experiment={"USER_FUNCTIONS": "mine"})
    assert demo_in_use(load_settings(path, env={})) is None


def test_what_a_library_warns_of_in_the_model_check_stays_off_the_terminal(
    tmp_path, capfd, monkeypatch
):
    """The check before any job runs load_model: a library's FutureWarning in it (PEFT calling
    a transformers API that warns) was printed on the terminal of every run and plan, where a
    job's warnings go to its log. The check's own findings are still said."""
    from pipeline.user_check import check_user_functions

    warns = REVIEWS.replace(
        "def load_model(model_name, id2label, label2id):",
        "def load_model(model_name, id2label, label2id):\n"
        "    import warnings\n"
        "    warnings.warn('`is_gradient_checkpointing` is deprecated', FutureWarning)",
    )
    assert warns != REVIEWS
    write_module(tmp_path, "warning_functions", warns)
    settings, _ = reviews_run(tmp_path, "warning_functions")
    monkeypatch.setenv("SMPIPE_CHECK_AGAIN", "1")  # a pass kept from an earlier test run
    check_user_functions(settings)
    said = capfd.readouterr()
    assert "FutureWarning" not in said.out + said.err and "deprecated" not in said.out + said.err
