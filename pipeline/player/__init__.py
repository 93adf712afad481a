"""SageMaker's data plane, played on this machine: what happens to a job between the request
SageMaker accepts and the status it reports. The control planes (pipeline/backends/local.py,
emulated/) decide what runs and hand each request here.

    play.py          a job from its request to its exits: every host's job root laid out,
                     inputs and checkpoints moved, the containers run (`play_processing`,
                     `play_training`), through a `ContainerRunner`
    exits.py         how a container ended (`ContainerExit`), and the status SageMaker
                     reports for a job whose containers ended so (`status_after`)
    job_root.py      laying out a job root (the folder that stands for /opt/ml) from the
                     request, and reading back what the entrypoint left in it
    environment.py   the environment a container starts with: Docker's, the image's ENV,
                     what SageMaker sets
    transfers.py     what SageMaker moves: inputs in, checkpoints both ways, outputs up, a
                     container's lines to CloudWatch Logs
    processes.py     a job's containers started, followed, stopped as `docker stop` stops
                     one (`Containers`), each through a launcher; the process player
                     (`ProcessLauncher`): a container as processes of this machine
    images.py        the image player (`ImageLauncher`): each host a container of the image
                     (docker or podman) on a network of the job's own
    metering.py      the memory and CPU time a container's processes use
    fork_server.py   the warm-start fork server, a program of its own (run as a script)
    fork_client.py   its client: how the local backend starts jobs warm (`WarmStart`)
    warm_pools.py    SageMaker's managed warm pools, as the emulated account keeps them

play.py runs containers through a `ContainerRunner`: `processes.Containers`, handed how to
start them (`processes.ProcessLauncher`, or the image player `images.ImageLauncher`).

The player imports no backend, no settings (pipeline/config.py) and no stage: what it needs of
a job is in its request.
"""
