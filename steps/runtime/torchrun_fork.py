"""torchrun for a warm-started job, whose workers are forked from it.

`python -m steps.runtime.torchrun_fork ARGS` takes torchrun's own command line and runs
torchrun's agent and rendezvous with it (`main`), but forks each worker from itself instead of
starting a new interpreter; the worker then becomes `python -m MODULE` (`forked_worker`). The
entrypoint runs it only inside a job the local backend's fork server forked, with torch and the
rest already imported (supervise.py `start_step`); in a container, torchrun itself runs.
"""

from __future__ import annotations

import os
import signal
import sys

# The signals torchrun's agent handles itself (torch/distributed/elastic/multiprocessing/api.py,
# PContext.start): a forked worker has its handlers and gets a new interpreter's instead.
AGENT_SIGNALS_VARIABLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def forked_worker(module: str, args: list[str]) -> None:
    """In a worker forked from the agent: what `python -u -m MODULE ARGS` does, with a new
    interpreter's signal dispositions; its exit status is the worker's."""
    from steps.runtime.fork import become_module

    for name in os.environ.get(AGENT_SIGNALS_VARIABLE, AGENT_SIGNALS).split(","):
        signum = getattr(signal, name.strip(), None)
        if signum is not None:
            fresh = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, fresh)
    apply_thread_count()
    code = become_module([sys.executable, "-m", module, *args])
    if code:
        sys.exit(code)


def apply_thread_count() -> None:
    """The intra-op thread count a new worker interpreter would take: torchrun sets
    OMP_NUM_THREADS=1 for its workers where it is unset and a host runs several
    (torch/distributed/run.py, config_from_args), and OpenMP reads it once, when torch loads
    it. A forked worker's torch was loaded in the server, with the server's count (every core
    where it was unset): each of several ranks would run as many threads as the host has cores,
    and compute otherwise than the same job's workers in a container."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def main(argv: list[str]) -> None:
    """torchrun's command line (`python -m torch.distributed.run ARGS`, launch.py), run as
    `torch.distributed.run.run` runs it, with one difference: torchrun starts a module's workers
    as new interpreters (`python -u -m MODULE`: config_from_args makes the entrypoint a command,
    and a command's workers are subprocesses), where this forks them, the way torchrun starts a
    function's workers (LaunchConfig's start_method "fork", torchrun's `--start-method`). Each
    worker gets the environment the agent gives it (RANK, WORLD_SIZE, MASTER_ADDR, ...); its
    start is a fork, not seconds of imports."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, _, command = config_from_args(parse_args(argv))
    # torchrun's worker command: ["-u", "-m", MODULE, *its arguments] (launch.py always runs a
    # module, and with use_env, torchrun's default, adds no --local-rank).
    module = command.index("-m") + 1
    config.start_method = "fork"
    record(elastic_launch(config, entrypoint=forked_worker))(command[module], command[module + 1 :])


if __name__ == "__main__":
    main(sys.argv[1:])
