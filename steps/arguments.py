"""The command line of each processing step, declared once: a table of `Argument`s per step.

Each step parses its ContainerArguments with `parse(TABLE)`, and the driver builds every job's
arguments from the same table (pipeline/stages.py `step_arguments`), so a flag, its type and the
words it takes are spelled here only. The driver imports this module: it imports nothing
heavier than argparse.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# What the inference and predict steps run: a program each ([inference] MODEL_FORMAT), at a
# precision the CPU computes ([inference] MIXED_PRECISION; auto: bf16 where it is fast,
# steps/precision.py). steps/model_files.py EXPORTS names each program's file.
MODEL_FORMATS = ("torchscript", "exported")
CPU_PRECISIONS = ("auto", "no", "bf16")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class Argument:
    """One flag of a step. No argument has a default: each is sent with every job, its value
    read from the settings (`setting`; the settings table holds its one default:
    steps/hyperparameters.py, pipeline/config_sections.py) or given by the job itself (the
    model an export is for). A job's arguments are part of a data step's cache key
    (pipeline/cache.py)."""

    flag: str
    type: type = str
    # "<section>.<field>" of the settings the driver reads its value from; "": the job gives
    # it (pipeline/stages.py `step_arguments`).
    setting: str = ""
    choices: tuple[str, ...] = ()
    help: str = ""

    @property
    def dest(self) -> str:
        """The name argparse gives it, and the keyword a job gives it by."""
        return self.flag.lstrip("-").replace("-", "_")


RECONCILE: tuple[Argument, ...] = ()

# Every argument is part of prepare's cache key: the same snapshot, code and arguments give
# the same splits.
PREPARE = (
    Argument("--model-names", setting="models.model_names", help="comma separated"),
    Argument("--max-length", int, "data.max_sequence_length"),
    Argument("--train-fraction", float, "data.train_fraction"),
    Argument("--validation-fraction", float, "data.validation_fraction"),
    Argument("--test-fraction", float, "data.test_fraction"),
    Argument("--seed", int, "data.seed"),
)

INFERENCE = (
    Argument("--model-names", setting="models.model_names", help="comma separated"),
    Argument("--batch-size", int, "inference.batch_size"),
    Argument("--model-format", setting="inference.model_format", choices=MODEL_FORMATS),
    Argument("--mixed-precision", setting="inference.mixed_precision", choices=CPU_PRECISIONS),
    # Each model is logged to wandb as a `model` artifact of its training run, with its test
    # metrics (steps/model_artifact.py).
    Argument("--wandb-mode", setting="tracking.wandb_mode", choices=WANDB_MODES),
    Argument("--wandb-project", setting="tracking.wandb_project"),
)

# After a study, its best model exported once (pipeline/stages.py `export_job`).
EXPORT = (
    Argument("--model-name"),
    Argument("--exports", help="comma separated: torchscript, exported"),
)

# `smpipe predict` with one model of a run (pipeline/predict/).
PREDICT = (
    Argument("--model-name"),
    Argument("--batch-size", int, "inference.batch_size"),
    Argument("--model-format", setting="inference.model_format", choices=MODEL_FORMATS),
    Argument("--mixed-precision", setting="inference.mixed_precision", choices=CPU_PRECISIONS),
    Argument("--text-columns", help="comma separated"),
)

TABLES = {
    "reconcile": RECONCILE,
    "prepare": PREPARE,
    "inference": INFERENCE,
    "export": EXPORT,
    "predict": PREDICT,
}


def parse(table: tuple[Argument, ...], argv: list[str] | None = None) -> argparse.Namespace:
    """A step's arguments, typed; argparse exits 2 naming the flag it refuses."""
    parser = argparse.ArgumentParser()
    for a in table:
        choices = a.choices or None
        parser.add_argument(a.flag, type=a.type, choices=choices, required=True, help=a.help)
    return parser.parse_args(argv)


def command_line(step: str, values: dict[str, object]) -> list[str]:
    """The ContainerArguments of a `step` job: `values` by dest, one for each argument of its
    table and no other; a list is sent comma separated."""
    table = TABLES[step]
    wanted = [a.dest for a in table]
    missing = [d for d in wanted if d not in values]
    unknown = [d for d in values if d not in wanted]
    if missing or unknown:
        raise ValueError(
            f"steps/arguments.py {step.upper()}: arguments missing {missing}, unknown {unknown}"
        )
    line = []
    for a in table:
        value = values[a.dest]
        text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        line += [a.flag, text]
    return line
