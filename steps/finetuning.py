"""What of the model trains: every weight (FINETUNING = full), or LoRA adapters with the
classification head in full (FINETUNING = lora, through PEFT); and gradient checkpointing.

The user's `load_model` returns the Hugging Face model as it always does; `prepare` wraps it (a
model already wrapped with PEFT is taken as it is). Checkpoints hold only what trains
(`trained_state`); at the end the adapters are merged into the weights (`final_model`).
"""

from __future__ import annotations

import copy
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from steps.hyperparameters import asks_of_the_model
from steps.model_files import ADAPTER
from steps.user_code import call, innermost_cause, input_keys


class FinetuningError(ValueError):
    """A finetuning setting that cannot apply to this model: names the key and the model."""


@dataclass(frozen=True)
class Finetuning:
    """How the model trains, as the job's report and checkpoints record it."""

    method: str  # full | lora
    settings: dict  # LoRA's r, alpha, dropout, target modules and head, as applied
    gradient_checkpointing: bool
    parameters: int
    trained_parameters: int

    def record(self) -> dict:
        return {
            "finetuning": self.method,
            **({"lora": self.settings} if self.method == "lora" else {}),
            "gradient_checkpointing": self.gradient_checkpointing,
            "parameters": self.parameters,
            "trained_parameters": self.trained_parameters,
        }


def is_peft(model: torch.nn.Module) -> bool:
    """Whether the model is PEFT's. A model can be one only once peft is imported, and importing
    it costs a job a second or more: a job that finetunes in full never does."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """The names of the model's transformer layers: the modules of the classes its
    `_no_split_modules` names (transformers marks the blocks it never splits across devices)
    that sit in a list (`encoder.layer.3`, `model.layers.0`; BERT also names its embeddings,
    which are not a layer), or else the longest ModuleList of modules of one class."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    named = [
        n
        for n, m in model.named_modules()
        if type(m).__name__ in classes and n.rsplit(".", 1)[-1].isdigit()
    ]
    if named:
        return named
    stacks = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList)
        and len(m) > 1
        and len({type(child) for child in m}) == 1
    ]
    if not stacks:
        return []
    name, longest = max(stacks, key=lambda s: len(s[1]))
    return [f"{name}.{i}" if name else str(i) for i in range(len(longest))]


def check_blocks(model: torch.nn.Module, name: str, module: str) -> list[str]:
    """The layers FSDP shards one by one (steps/fsdp.py), refused by name where there are none."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise FinetuningError(
            f"DISTRIBUTED_STRATEGY = fsdp: model {name!r} ({module}.load_model, "
            f"{type(model).__name__}) names no layer classes in _no_split_modules and has no "
            "list of repeated layers to shard one by one; set DISTRIBUTED_STRATEGY = ddp for it"
        )
    return blocks


def skeleton(model: torch.nn.Module, name: str, module: str) -> torch.nn.Module:
    """The model with its weights on the meta device (no memory), its buffers and everything
    else copied: what FSDP's final model is gathered into (steps/fsdp.py `gathered`). A model that
    holds what cannot be copied (a lock, an open file) is refused by name."""
    memo = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for p in model.parameters()
    }
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - whatever the user's module holds
        raise FinetuningError(
            f"DISTRIBUTED_STRATEGY = fsdp: model {name!r} ({module}.load_model) cannot be copied "
            f"(copy.deepcopy raised {type(e).__name__}: {e}); the final model is gathered into "
            "a copy of it: keep locks, files and threads out of the model, or set "
            "DISTRIBUTED_STRATEGY = ddp"
        ) from None


def lora_targets(model: torch.nn.Module, wanted: str, module: str, model_name: str) -> list[str]:
    """LORA_TARGET_MODULES as PEFT matches them (a module whose name is a target or ends with
    `.target`). auto: every linear layer inside the repeated blocks, named from the block
    (`attention.self.query`, `mlp.down_proj`): the attention and MLP projections."""
    names = [n for n, _ in model.named_modules()]
    if wanted != "auto":
        targets = [t.strip() for t in wanted.split(",") if t.strip()]
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched or not targets:
            raise FinetuningError(
                f"LORA_TARGET_MODULES = {wanted}: {', '.join(unmatched) or 'no name'} matches "
                f"no module of model {model_name!r} ({module}.load_model; its modules end "
                f"with: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in names if n})[:30])})"
            )
        return targets
    blocks = repeated_blocks(model)
    relative = set()
    for block in blocks:
        for name, sub in model.get_submodule(block).named_modules():
            if isinstance(sub, torch.nn.Linear) and name:
                relative.add(name)
    if not relative:
        raise FinetuningError(
            f"LORA_TARGET_MODULES = auto: model {model_name!r} ({module}.load_model, "
            f"{type(model).__name__}) has no repeated blocks with linear layers to adapt; "
            "name the modules in LORA_TARGET_MODULES"
        )
    return sorted(relative)


def head_modules(
    model: torch.nn.Module, num_labels: int | None, module: str, name: str
) -> list[str]:
    """The classification head, which trains in full (PEFT's `modules_to_save`). For a Hugging
    Face model: what lies after its repeated blocks, the base model's modules registered after
    the one holding them (BERT's pooler, which a checkpoint trained for embeddings, MiniLM's
    among them, does not hold and `from_pretrained` initializes anew; Llama's final norm), and
    its top-level modules other than the base model (`classifier`, `score`). For another
    module: the top-level module holding the last linear layer with one output per label (any
    last linear layer where the labels are not known yet: `num_labels` None)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, torch.nn.Module):
        # After the last child holding blocks: an encoder-decoder (BART, T5) holds them in two.
        blocks = [b for b in repeated_blocks(model) if b.startswith(f"{prefix}.")]
        holders = {b.split(".")[1] for b in blocks}
        children = [n for n, _ in base.named_children()]
        held = [i for i, n in enumerate(children) if n in holders]
        after = children[held[-1] + 1 :] if held else []
        heads = [
            f"{prefix}.{n}" for n in after if any(True for _ in base.get_submodule(n).parameters())
        ]
        heads += [
            n
            for n, child in model.named_children()
            if n != prefix and any(True for _ in child.parameters())
        ]
        if heads:
            return heads
    last = [
        n.split(".")[0]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and num_labels in (None, m.out_features)
    ]
    if not last:
        raise FinetuningError(
            f"FINETUNING = lora: model {name!r} ({module}.load_model, {type(model).__name__}) "
            f"has no linear layer of {num_labels} outputs to train in full as its head"
        )
    return [last[-1]]


# The modules LoRA adds inside each adapted layer (PEFT's LoraLayer).
ADAPTER_PARTS = (
    "base_layer",
    "lora_dropout",
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
)


def check_heads_alone(heads: list[str], names: list[str], module: str, name: str) -> None:
    """PEFT finds modules_to_save by the end of their names alone (`key.endswith(name)`,
    peft/utils/other.py `_set_trainable`), among the model's modules and the parts LoRA adds to
    each adapted layer: a head called `out` would also catch every adapter's `lora_dropout`
    (PEFT then fails) or a block's `attn.out`, and no other spelling singles it out (a leading
    dot or a longer name matches nothing, and the head stays frozen without a word)."""
    caught = {
        head: [n for n in [*names, *ADAPTER_PARTS] if n != head and n.endswith(head)][:3]
        for head in heads
    }
    caught = {head: others for head, others in caught.items() if others}
    if caught:
        said = "; ".join(f"{h} also ends {', '.join(o)}" for h, o in caught.items())
        raise FinetuningError(
            f"FINETUNING = lora: model {name!r} ({module}.load_model) has a head PEFT cannot "
            f"name alone ({said}): PEFT finds the modules it trains in full by the end of their "
            "names; give the head a name of its own (`classifier`), or wrap the model with "
            "peft.get_peft_model in load_model"
        )


def prepare(
    model: torch.nn.Module, hp: dict, num_labels: int | None, module: str
) -> tuple[torch.nn.Module, Finetuning]:
    """The model as it trains: gradient checkpointing on where asked, LoRA adapters where
    asked (or the user's own PEFT model, checked); and what was applied."""
    name = hp["model_name"]
    if hp["gradient_checkpointing"]:
        enable_checkpointing(model.get_base_model() if is_peft(model) else model, name, module)
    if getattr(model, "_hf_peft_config_loaded", False):  # transformers' own add_adapter
        raise FinetuningError(
            f"model {name!r}: {module}.load_model returned a model with adapters added by "
            "transformers' add_adapter; return it without them (FINETUNING = lora adds LoRA's), "
            "or wrap it with peft.get_peft_model"
        )
    settings: dict = {}
    if hp["finetuning"] == "lora" and is_peft(model):
        settings = user_peft_model(model, name, module)
    elif hp["finetuning"] == "lora":
        model, settings = add_lora(model, hp, num_labels, module)
    elif is_peft(model):
        raise FinetuningError(
            f"model {name!r}: {module}.load_model returned a PEFT model, and FINETUNING is full; "
            "set FINETUNING = lora for it, or return the model without its adapters"
        )
    parameters = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    method = hp["finetuning"]
    return model, Finetuning(method, settings, hp["gradient_checkpointing"], parameters, trained)


def enable_checkpointing(base: torch.nn.Module, name: str, module: str) -> None:
    """The model's own gradient checkpointing, non-reentrant: it recomputes exactly what the
    forward did (dropout included) and needs no input that requires a gradient, which frozen
    embeddings under LoRA would not give (https://pytorch.org/docs/stable/checkpoint.html).
    transformers 5 renamed it activation_checkpointing_enable (the old name warns)."""
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(base, "gradient_checkpointing_enable"):
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise FinetuningError(
            f"GRADIENT_CHECKPOINTING = true: model {name!r} ({module}.load_model, "
            f"{type(base).__name__}) has no gradient_checkpointing_enable (a transformers "
            "PreTrainedModel has); set it to false for this model"
        )


def add_lora(
    model: torch.nn.Module, hp: dict, num_labels: int | None, module: str
) -> tuple[torch.nn.Module, dict]:
    """PEFT's LoRA on the targets, the head in full; the model and the settings applied."""
    from peft import LoraConfig, get_peft_model

    name = hp["model_name"]
    targets = lora_targets(model, hp["lora_target_modules"], module, name)
    heads = head_modules(model, num_labels, module, name)
    targets = [t for t in targets if not any(t == h or t.startswith(h + ".") for h in heads)]
    if not targets:
        raise FinetuningError(
            f"LORA_TARGET_MODULES = {hp['lora_target_modules']}: model {name!r} "
            f"({module}.load_model) has no module to adapt outside its head "
            f"({', '.join(heads)}, which trains in full)"
        )
    check_heads_alone(heads, [n for n, _ in model.named_modules()], module, name)
    config = LoraConfig(
        r=hp["lora_r"],
        lora_alpha=hp["lora_alpha"],
        lora_dropout=hp["lora_dropout"],
        target_modules=targets,
        modules_to_save=heads,
    )
    settings = {
        "r": hp["lora_r"],
        "alpha": hp["lora_alpha"],
        "dropout": hp["lora_dropout"],
        "target_modules": targets,
        "modules_to_save": heads,
    }
    return get_peft_model(model, config), settings


def user_peft_model(model: torch.nn.Module, name: str, module: str) -> dict:
    """A PEFT model load_model made, taken as it is where it can train and be merged: what it
    is, for the report."""
    config = model.peft_config[model.active_adapter]
    kind = str(config.peft_type.value)
    if not callable(getattr(model.base_model, "merge_and_unload", None)):
        raise FinetuningError(
            f"model {name!r}: {module}.load_model returned a PEFT model of type {kind}, whose "
            "adapters cannot be merged into the weights; FINETUNING = lora takes LoRA's (or "
            "return the model without adapters and let the pipeline add them)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise FinetuningError(
            f"model {name!r}: {module}.load_model returned a PEFT model with nothing to train "
            "(PeftModel.from_pretrained loads adapters frozen unless is_trainable=True)"
        )
    for head in frozen_as_initialized(model, name, module):
        print(
            f"warning: model {name!r}: the PEFT model {module}.load_model built leaves {head} "
            "frozen, and its weights are an untrained layer's (zero biases, as MiniLM's BERT "
            "pooler, which no pretraining of it trained), so it stays as it is and the head "
            f"learns from noise: add {head.rsplit('.', 1)[-1]!r} to LoraConfig's "
            "modules_to_save, or return the model unwrapped (FINETUNING = lora trains it)",
            flush=True,
        )
    return {"from": "load_model", "peft_type": kind}


def frozen_as_initialized(model: torch.nn.Module, name: str, module: str) -> list[str]:
    """The head's modules (`head_modules`, as FINETUNING = lora would train them in full) that
    a user's PEFT model leaves frozen while their biases are all zero: a layer never trained
    (transformers' `_init_weights` zeroes a Linear's bias, and training moves it; MiniLM's
    checkpoint holds its pooler so). PEFT's SEQ_CLS default saves `classifier` and `score`
    alone; LoRA on MiniLM so learned next to nothing (accuracy 0.27 against 0.60)."""
    try:
        heads = head_modules(model.get_base_model(), None, module, name)
    except FinetuningError:
        return []
    named = dict(model.named_parameters())
    found = []
    for head in heads:
        held = {n: p for n, p in named.items() if f".{head}." in f".{n}"}
        biases = [p for n, p in held.items() if n.endswith("bias")]
        if (
            biases
            and not any(p.requires_grad for p in held.values())
            and all(p.device.type != "meta" and not p.detach().any() for p in biases)
        ):
            found.append(head)
    return found


# The labels the check's models are built with: the real ones come from reconcile, later.
# Three, not two: a transformers model built without num_labels has two outputs (its
# config's default: "Keep the default value of `num_labels=2`", transformers'
# configuration_utils.py), which two would not tell from one built for the labels it is given.
CHECK_LABELS = {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
# What transformers names a table of learned absolute positions: BERT's, RoBERTa's and
# DistilBERT's `position_embeddings`, GPT-2's `wpe`, BART's and OPT's `embed_positions`.
POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")


def not_taken_by_name(model: torch.nn.Module, keys) -> list[str]:
    """The keys `forward` takes no argument by the name of: training and validation call
    `model(**inputs)` with ordered_input_keys' names (the exports alone call it in order)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward Python cannot read the signature of
        return []
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return []
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [key for key in keys if key not in named]


def positions_embedded(model: torch.nn.Module) -> tuple[int, str] | None:
    """The most positions a model with learned absolute positions can embed, and the table
    that holds them, less the rows no position uses (RoBERTa's positions start past its
    padding index; BART's and OPT's tables keep an `offset` of 2); None for a model without
    such a table (rotary or relative positions, a bag of embeddings)."""
    found = []
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding):
            continue
        if module_name.rsplit(".", 1)[-1] not in POSITION_TABLES:
            continue
        unused = getattr(module, "offset", 0)
        if module.padding_idx is not None:
            unused += module.padding_idx + 1
        found.append((module.num_embeddings - unused, module_name))
    return min(found) if found else None


def input_problems(functions, name: str, model: torch.nn.Module) -> list[str]:
    """What ordered_input_keys returns, checked (steps/user_code.py `input_keys`), and against
    the arguments of the model's forward: training calls it with each input by name."""
    try:
        keys = input_keys(functions, name)
    except ValueError as e:  # what it returned, said as it is
        return [f"model {name!r}: {e}"]
    missing = not_taken_by_name(model, keys)
    if not missing:
        return []
    return [
        f"model {name!r}: {functions.module}.load_model's {type(model).__name__}.forward() takes "
        f"no argument named {', '.join(map(repr, missing))}, which ordered_input_keys names: "
        "training calls forward with each input by that name"
    ]


def check_models(functions, settings: dict[str, dict]) -> list[str]:
    """Before any job: every model of MODEL_NAMES built by the user's load_model on the meta
    device (Accelerate's init_empty_weights: no memory is allocated for the weights, so a 7B
    model built from its config is checked in a second; `from_pretrained` still reads its
    checkpoint's files), so that a name load_model does not know fails here and not in its
    training job; and where its settings ask something of it (hyperparameters.py
    `asks_of_the_model`), its LoRA targets, head, gradient checkpointing and FSDP layers found
    as the training job finds them (the head by its place: the labels are not known yet);
    ordered_input_keys against its forward's arguments (for a run that trains), and
    MAX_SEQUENCE_LENGTH against the positions it embeds (`positions_embedded`). Every problem,
    each naming the model, the key and load_model."""
    from accelerate import init_empty_weights

    problems = []
    for name, hp in settings.items():
        doing = f"calling {functions.module}.load_model({name!r}, ...) on the meta device"
        try:
            with init_empty_weights():
                model, given = built_for_the_check(functions, name)
            if given == 0:  # a head for labels of its own: its training job checks it
                continue
            if not isinstance(model, torch.nn.Module):
                problems.append(
                    f"{functions.module}.load_model({name!r}, ...) must return a torch.nn.Module, "
                    f"got {type(model).__name__} (MODEL_NAMES names {name!r})"
                )
                continue
            if said := fixed_width(model, name, functions.module, given):
                print(f"warning: {said}", flush=True)  # the driver's output (user_check.py)
            doing = f"calling {functions.module}.ordered_input_keys({name!r})"
            if hp.get("trains", True):  # a run of data steps alone may hold a stand-in model
                problems += input_problems(functions, name, model)
            embedded, max_length = positions_embedded(model), hp.get("max_sequence_length")
            if embedded and max_length and max_length > embedded[0]:
                problems.append(
                    f"[data] MAX_SEQUENCE_LENGTH = {max_length}: model {name!r} "
                    f"({functions.module}.load_model) embeds at most {embedded[0]} positions "
                    f"({embedded[1]}), and a longer row would fail its forward pass: set "
                    f"{embedded[0]} or less"
                )
            if said := problem_type_problem(model, name, functions.module, hp):
                problems.append(said)
            peft_trains = is_peft(model) and hp.get("trains", True)  # it asks of FINETUNING
            if not asks_of_the_model(hp) and not peft_trains:
                continue
            doing = (
                f"checking FINETUNING, GRADIENT_CHECKPOINTING and DISTRIBUTED_STRATEGY against "
                f"{functions.module}.load_model (built on the meta device)"
            )
            model, _ = prepare(model, {**hp, "model_name": name}, None, functions.module)
            if hp["distributed_strategy"] == "fsdp":
                check_blocks(model, name, functions.module)
                skeleton(model, name, functions.module)
        except FinetuningError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001 - the user's code, or PEFT on what it returned
            problems.append(f"model {name!r}: {doing} raised {type(e).__name__}: {e}")
    return problems


# The config's problem_type (transformers' PretrainedConfig) that is no single-label classifier:
# its own forward would compute another loss, and transformers' pipeline would read the saved
# config so ("multi_label_classification": a sigmoid per label, scores that sum to more than 1).
OTHER_PROBLEMS = ("multi_label_classification", "regression")


def problem_type_problem(model, name: str, module: str, hp: dict) -> str | None:
    """A model built for another problem than one label per row, which the training job's
    softmax cross-entropy trains: said before any job, not found in its saved config."""
    kind = getattr(getattr(model, "config", None), "problem_type", None)
    if not hp.get("trains", True) or kind not in OTHER_PROBLEMS:
        return None
    return (
        f"model {name!r}: {module}.load_model built a model whose config says problem_type = "
        f"{kind!r}; the pipeline trains one label per row (softmax cross-entropy, as "
        "'single_label_classification'), and its saved config would tell transformers' pipeline "
        "otherwise: build it without problem_type, or with 'single_label_classification'"
    )


def built_for_the_check(functions, name: str) -> tuple[object, int]:
    """What load_model builds for CHECK_LABELS, and how many labels it was given; one that
    refuses three (a head made for two: a binary task's, say) is built for two, as the data
    may have exactly two. None where the stand-in labels cannot fit a head the checkpoint
    holds for labels of its own (a model this pipeline trained, loaded again with
    `num_labels=len(id2label)`: transformers refuses the other sizes unless
    `ignore_mismatched_sizes=True`), said: the data's labels, which reconcile makes, are
    what it is built for in its training job."""
    try:
        labels = CHECK_LABELS
        return call(functions, "load_model", name, labels, labels_to_ids(labels)), len(labels)
    except RuntimeError:  # the user's error (steps/user_code.py `call`)
        labels = dict(list(CHECK_LABELS.items())[:2])
        try:
            return call(functions, "load_model", name, labels, labels_to_ids(labels)), 2
        except RuntimeError as e:
            if "ignore_mismatched_sizes" not in str(innermost_cause(e)):
                raise
            print(
                f"note: {functions.module}.load_model({name!r}, ...) loads a head for labels of "
                "its own, which the stand-in labels of this check do not fit: its training job "
                "checks it, for the data's labels",
                flush=True,
            )
            return None, 0


def labels_to_ids(id2label: dict[int, str]) -> dict[str, int]:
    return {label: i for i, label in id2label.items()}


def fixed_width(model: torch.nn.Module, name: str, module: str, given: int) -> str | None:
    """What to say of a transformers model built with outputs of its own number whatever labels
    `load_model` is given (its config's num_labels): `from_pretrained` without num_labels, as
    a model's card loads it. Its training job fails unless the data has that many labels,
    after the data steps and the models before it; a model of one's own is found by the job."""
    width = getattr(getattr(model, "config", None), "num_labels", None)
    if not isinstance(width, int) or width == given:
        return None
    return (
        f"{module}.load_model({name!r}, ...) built a model of {width} outputs when given "
        f"{given} labels (its config.num_labels): its training job fails unless the "
        f"data has {width} labels; pass num_labels=len(id2label) to from_pretrained"
    )


def name_classes(model: torch.nn.Module, id2label: dict[int, str], built: str, say: bool) -> None:
    """A transformers model's config names its classes as the data does (prepare's
    id2label.json), for whoever loads the config.json it is saved with
    (pipeline("text-classification") reports config.id2label's names). One built with
    num_labels alone says LABEL_0...; one that names them otherwise (a map of the user's own,
    as the transformers tutorial writes one) is said (`say`: the main process): code that reads
    its classes from that map would mislabel every prediction."""
    config = getattr(model, "config", None)
    if len(getattr(config, "id2label", None) or {}) != len(id2label):
        return  # another number of outputs: the job refuses it (check_output_width)
    own = {int(k): v for k, v in config.id2label.items()}
    if say and own != id2label and own != {k: f"LABEL_{k}" for k in own}:
        print(
            f"warning: {built} built a model whose config names its classes {shown(own)}; the "
            f"data's class ids are {shown(id2label)} (id2label.json): it trains and is saved "
            "with the data's. Pass load_model's id2label and label2id to from_pretrained"
        )
    config.id2label, config.label2id = dict(id2label), labels_to_ids(id2label)


def shown(id2label: dict[int, str], at_most: int = 8) -> str:
    """A class map for a log line: its first `at_most` ids, and how many more."""
    first = dict(sorted(id2label.items())[:at_most])
    more = len(id2label) - len(first)
    return f"{first}" if not more else f"{str(first)[:-1]}, ... and {more} more}}"


def trained_state(model: torch.nn.Module, method: str) -> dict[str, torch.Tensor]:
    """What a checkpoint or the best weights hold, on the CPU: the whole state dict when every
    weight trains; with LoRA only what requires a gradient (the adapters and the head, the set
    PEFT's own `save_pretrained` saves). The optimizer holds only that too."""
    if method == "full":
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trained_state(model: torch.nn.Module, state: dict, method: str) -> None:
    """The inverse of `trained_state`: every key it names must be the model's, in its shape,
    and with LoRA every trained weight must be there; checked before anything is loaded."""
    own = (
        model.state_dict()
        if method == "full"
        else {n: p for n, p in model.named_parameters() if p.requires_grad}
    )
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and own[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        raise KeyError(
            f"checkpoint is for another model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, other shapes {wrong[:5]}"
        )
    model.load_state_dict(state, strict=method == "full")


def final_model(model: torch.nn.Module, model_dir: Path) -> torch.nn.Module:
    """The model written as the job's output: with LoRA, the adapter saved in PEFT's format
    (`model_dir/adapter`: a few MB, so a tuning trial writes it too, and the study's best model
    keeps it; `PeftModel.from_pretrained(base, <model>/adapter)` loads it) and then merged into
    the weights (`merge_and_unload`), so the final model is a plain model that
    `from_pretrained`, the exports and inference read as any other."""
    if not is_peft(model):
        return model
    model.save_pretrained(model_dir / ADAPTER)
    return model.merge_and_unload()
