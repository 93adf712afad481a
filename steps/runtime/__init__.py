"""The container's side of the job contract, by concern (as sagemaker-training-toolkit splits
its own): `names` (every path, file, variable and marker, once), `variables` (the job's config
files as the SM_* variables), `environment` (those variables as a step reads them), `secrets`
(Secrets Manager, masking), `launch` (the step's command line, torchrun), `supervise` (the
step's process, signals, exit status and failure file), `fork` (becoming `python -m X` in a
fork), `torchrun_fork` (a warm-started job's torchrun, whose workers it forks), `step` (what a
step script calls: run_step, write_step_metadata). steps/entrypoint.py puts them together. At
import, the standard library only (boto3 and psutil where used): no torch, nothing of steps/
outside this package, nothing of pipeline/.
"""
