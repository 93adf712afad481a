"""The image's entrypoint: SageMaker's bring-your-own-container contract, for every job.

    python3 -m steps.entrypoint train                      a training job (and every tuning trial)
    python3 -m steps.entrypoint process STEP [ARGS ...]    a processing job running steps/STEP.py

It reads as sagemaker-training-toolkit's trainer.py `train()`: the environment (`set_up`), the
step run and supervised, the failure file, the exit status (`main`). It ships with the run's
code, found on the image's PYTHONPATH (names.TRAINING_CODE_DIR, PROCESSING_CODE_DIR); what
each job gets is docs/container-contract.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from steps.runtime import names
from steps.runtime.environment import image_record, ml_root
from steps.runtime.launch import processing_command, training_command
from steps.runtime.names import host_path
from steps.runtime.secrets import keys_from_secrets
from steps.runtime.supervise import failed_to_start, follow_driver, supervise
from steps.runtime.variables import processing_variables, training_variables

USAGE = f"usage: {' '.join(names.ENTRYPOINT)} train | process STEP [ARGS ...]"


def set_up(root: Path, argv: list[str]) -> tuple[list[str], dict[str, str], str, list[Path]]:
    """The step's command, its environment, its name in messages and its output folders.

    A training job exports the SM_* variables SageMaker's framework containers export
    (steps/runtime/variables.py) and runs under torchrun across every host and process when
    there are several (steps/runtime/launch.py); a processing job exports
    SM_PROCESSING_INPUT_<NAME> / SM_PROCESSING_OUTPUT_<NAME>. Both read the keys that Secrets
    Manager secrets name, in the job's own region (steps/runtime/secrets.py)."""
    if argv[0] == "train":
        env = {**training_variables(root), **keys_from_secrets(root)}
        Path(env[names.SM_CHECKPOINT_DIR]).mkdir(parents=True, exist_ok=True)
        model = host_path(root, names.MODEL_DIR)
        for folder in (model, host_path(root, names.OUTPUT_DATA_DIR)):
            folder.mkdir(parents=True, exist_ok=True)
        return training_command(env), env, "the training step", [model]
    env = {**processing_variables(root), **keys_from_secrets(root)}
    outputs = [Path(v) for k, v in env.items() if k.startswith(names.PROCESSING_OUTPUT_PREFIX)]
    return processing_command(argv[1], argv[2:]), env, f"step {argv[1]}", outputs


def main(argv: list[str]) -> int:
    """Runs the step under `supervise` (steps/runtime/supervise.py): SIGTERM and SIGINT go on to
    the processes that train and the step is waited for (its checkpoint); a failed step leaves
    its one-paragraph reason in the failure file, which SageMaker returns as FailureReason or
    ExitMessage; the exit status is the step's (75 when it checkpointed on a signal). The job
    root is `/opt/ml`, or SMPIPE_ML_ROOT locally (names.ML_ROOT_VARIABLE)."""
    root = ml_root()
    follow_driver()
    if argv[:1] not in (["train"], ["process"]) or (argv[0] == "process" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    if (record := image_record()) is not None:
        print(record, flush=True)
    failure = host_path(root, names.FAILURE_FILES[argv[0]])
    try:
        command, env, what, outputs = set_up(root, argv)
    except Exception as e:  # noqa: BLE001 - whatever it is, SageMaker must be told why
        return failed_to_start(failure, e)
    return supervise(command, env, Path(env[names.SM_OUTPUT_FAILURE]), what, outputs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
