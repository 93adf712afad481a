"""`smpipe`: the command line. `python run_pipeline.py settings.ini` is `smpipe run settings.ini`.

Its arguments and options are parsed by parser.py, each command is run by commands.py; main()
here answers the errors they raise with an exit status, and a stdout closed early quietly.
"""

from __future__ import annotations

import os
import sys

from pipeline.cli.commands import COMMANDS, open_experiment
from pipeline.cli.parser import build_parser

# What scripts outside the command line use: `smpipe` itself, and a command's settings and store.
__all__ = ["main", "open_experiment"]


def main(argv: list[str] | None = None) -> int:
    """The command's exit status. A Ctrl-C before the command has begun (its imports take a
    second) ends it as one during it does, without a traceback through them."""
    for name in ("stdout", "stderr"):  # started with one closed (`>&-`): Python sets None
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - the process's own
    from pipeline.interrupts import restored

    with restored():
        try:
            return command(argv)
        except KeyboardInterrupt as e:
            return interrupted("", e)


def command(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        # No command: the commands and examples, on stderr with status 2, as argparse answers
        # any other missing argument (so `smpipe $COMMAND` with an empty variable fails).
        build_parser().print_help(sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)  # --version and --help print here
    except BrokenPipeError:
        if not stdout_closed():
            raise
        return quiet_exit()
    from pipeline.config import ConfigError
    from pipeline.errors import PipelineError, Refused
    from pipeline.history import HistoryError
    from pipeline.project import ProjectError
    from pipeline.prune import PruneError
    from pipeline.store import StoreError
    from steps.user_code import UserFunctionError

    try:
        return flushed(COMMANDS[args.command](args))
    except BrokenPipeError:
        if not stdout_closed():
            raise
        return quiet_exit()
    except (ConfigError, UserFunctionError, ProjectError, Refused, HistoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (PipelineError, StoreError, PruneError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        return interrupted(args.command, e)


# What each command that writes leaves when it is stopped (pipeline/interrupts.py).
STOPPED = {
    "run": "its jobs were stopped; a run it had begun is marked interrupted and its completed "
    "outputs stay",
    "predict": "its job was stopped; OUTPUT and OUTPUT.json are as they were (the run keeps the "
    "job's log, if it started, with a record saying so)",
    "prune": "a run it had begun to prune is marked pruned (`smpipe prune` again finishes it); "
    "every other run is as it was",
}


def interrupted(command: str, error: KeyboardInterrupt) -> int:
    """Status 130, once it is said on stderr why and what is left: said where it can be (a
    stop because stdout's reader went away may have taken stderr with it)."""
    from pipeline.interrupts import done, why_stopped

    done()  # all that is left is to say so: a further Ctrl-C is not "still stopping" anything
    if stdout_closed():
        quiet_exit()
    notes = "".join(f" ({note})" for note in getattr(error, "__notes__", []))  # the run's
    try:
        left = f"; {STOPPED[command]}" if command in STOPPED else ""
        print(f"interrupted: {why_stopped(error)}{left}{notes}", file=sys.stderr, flush=True)
    except OSError:
        pass
    return 130


def flushed(code: int) -> int:
    """`code`, once stdout is flushed: a pipe closed early (`smpipe runs S | head -1`) says
    so here, inside main()'s try, not at exit as an "Exception ignored" traceback."""
    sys.stdout.flush()
    return code


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone: the BrokenPipeError is that pipe's,
    not one of a job's. Linux marks such a pipe's write end POLLERR (fs/pipe.c, pipe_poll:
    `if (!pipe->readers) mask |= EPOLLERR`)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # not a file (pytest's capture), no poll
        return False
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def quiet_exit() -> int:
    """The reader of stdout has gone: say nothing more, as the Python docs' recipe for a
    closed pipe does (https://docs.python.org/3/library/signal.html#note-on-sigpipe):
    stdout pointed at /dev/null, so that the flush at exit does not fail again, and status 1,
    Python's own on EPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1
