"""BACKEND = emulated: SageMaker without AWS and without Docker.

The SageMaker backend runs unchanged: it checks each request against SageMaker's service
model (pipeline/service_model.py), sends it to an embedded moto server, waits on it, reads
its CloudWatch logs, stops it, adopts its outputs. moto accepts a job and runs nothing; this
package plays SageMaker's part for each job it accepted, by rules taken from AWS's own
documentation and published job output, each cited where it is played (docs/sagemaker.md's
table lists them, and what is not played). By concern:

    account.py        the emulated account: moto started, the clients that reach it, the
                      plumbing a job reaches it with, the store the jobs see (`S3View`)
    records.py        moto's records moved as SageMaker moves them: statuses, FailureReason
                      and ExitMessage, billing, final metrics, warm pools
                      (player/warm_pools.py), a tuning job's counters and best trial
    instances.py      processing and training jobs played by the player (pipeline/player/):
                      the job root laid out, the image's entrypoint run in a new container's
                      environment (in the image with `--image`, else as processes forked
                      warm), CloudWatch Logs written, outputs uploaded; a spot job restarted
                      only when its instance is taken back (`Emulator.reclaim`)
    tuning.py         the tuning service: trials drawn from the request's ParameterRanges,
                      each a training job with `_tuning_objective_metric`, its objective read
                      with the request's metric regexes, the best one reported (with a
                      warm start's, the best of its parents' too); a trial is created
                      through the control plane's callback
    control_plane.py  SageMaker's control plane as hooks on the client's calls (`Emulator`):
                      a job started once moto accepts it, a name used before refused
                      (ResourceInUse), a warm start's unknown parents refused, the Stop*
                      calls, a tuning job's trials listed, a model package's ClientToken,
                      warm pools expired before anyone looks
    adapter.py        the backend the driver holds (`EmulatedBackend`, `emulated_backend`)

Each module imports only modules listed above it, never this package.
"""

from pipeline.backends.emulated.account import (
    EMULATED_BUCKET,
    S3View,
    job_plumbing,
    open_emulated_store,
    start_moto,
)
from pipeline.backends.emulated.adapter import EmulatedBackend, emulated_backend
from pipeline.backends.emulated.control_plane import Emulator, used_name_message

__all__ = [
    "EMULATED_BUCKET",
    "EmulatedBackend",
    "Emulator",
    "S3View",
    "emulated_backend",
    "job_plumbing",
    "open_emulated_store",
    "start_moto",
    "used_name_message",
]
