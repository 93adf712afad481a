"""Where jobs run: the backends, held by the protocols of pipeline/backend.py. Every backend runs
the very requests pipeline/jobs.py builds and reports a jobs.JobResult whose status is
SageMaker's word (Completed, Failed or Stopped). The local and emulated backends play jobs
through pipeline/player/, SageMaker's data plane on this machine.

    choose.py        the backend [experiment] BACKEND names, built for one run
    local.py         every job played on this machine, against the store directly
    local_tuning.py  the local backend's tuning jobs: Optuna's study, its trials local jobs
    sagemaker.py     every job sent to SageMaker, followed and adopted into the run tree
    emulated/        the SageMaker backend against an embedded moto, which plays its jobs
"""
