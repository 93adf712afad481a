"""Where jobs run: the backends. The protocols their callers hold them by (`Backend`,
`TrialRunner`), and the image and role their requests name, are pipeline/backend.py.

    choose.py        the backend [experiment] BACKEND names, built for one run
    local.py         every job played on this machine, against the store directly
    local_tuning.py  the local backend's tuning jobs: Optuna's study, its trials local jobs
    sagemaker.py     every job sent to SageMaker, followed and adopted into the run tree
    emulated/        the SageMaker backend talking to an embedded moto, which plays its jobs
                     as SageMaker would: the emulated account, SageMaker's control plane, its
                     instances and its tuning service, a module each (emulated/__init__.py)

What the local and emulated backends share, SageMaker's data plane played on this machine (job
roots, processes, exits read as a status), is pipeline/player/.

Every backend runs the very requests pipeline/jobs.py builds (`request_for`, one per kind:
jobs.KINDS), and reports each job as a jobs.JobResult whose status is SageMaker's word for
how it ended (player/exits.py `Status`: Completed, Failed or Stopped).
"""
