"""What a job's processes use, metered as a container's would be: peak memory of the whole
process tree, and CPU time (its own and that of every process it waited for)."""

from __future__ import annotations

import os
import subprocess
import threading
import time


def watch_memory(pid: int, peak: dict, stop: threading.Event) -> None:
    """Peak memory of the job's whole process tree (torchrun's workers too), and its CPU time so
    far, into `peak`. Memory as the job's container would hold it: each process's own pages
    (USS), and the pages processes share counted once (the largest shared part). Summing RSS
    would count a shared page once per process: a warm-started job's entrypoint and step share
    the libraries their fork server imported (fork_server.py), and their RSS summed overstates
    what the same job holds started cold (docs/performance.md).

    USS comes from Linux's smaps_rollup (psutil memory_full_info), which walks the process's
    page tables: milliseconds of the kernel's time for a process that has imported torch, and a
    job's tree has several. RSS (statm) costs microseconds and bounds the figure: own + shared
    is at most the RSS summed. So the tree's RSS is read on every tick, and smaps_rollup only
    where a new peak is possible (RSS summed above the peak) and either the tree has grown since
    the last reading (`GROWN`) or the last one is old enough that reading costs at most
    `READ_SHARE` of a core. Between two readings of a tree that has not grown, the figure can
    miss what copy-on-write turns from shared into own, at most the shared part."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    # RSS every 0.5 s, and more often at first: a warm-started job may end within half a
    # second. CPU time every 0.05 s (a read of /proc/<pid>/stat a process) over the processes
    # last seen: the figure that stands when a job's exact one cannot be had (exit_cpu_seconds).
    procs, pause, memory_due = [root], 0.02, 0.0
    read_rss, read_due = 0, 0.0  # RSS summed at the last smaps_rollup reading; the next one due
    while not stop.wait(min(pause, CPU_SAMPLE_SECONDS)):
        now = time.monotonic()
        if now >= memory_due:
            memory_due, pause = now + pause, min(0.5, pause * 2)
            try:
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
                if rss > peak["rss"] and (rss > read_rss * GROWN or now >= read_due):
                    started = time.thread_time()
                    memory = [p.memory_full_info() for p in procs if p.is_running()]
                    read_rss, read_due = rss, now + (time.thread_time() - started) / READ_SHARE
                    own = sum(m.uss for m in memory)
                    shared = max((m.rss - m.uss for m in memory), default=0)
                    peak["rss"] = max(peak["rss"], own + shared)
            except psutil.Error:
                continue
        peak["cpu"] = max(peak["cpu"], _cpu_of(procs))


# A tree whose RSS summed is this much larger than at the last smaps_rollup reading is read
# again at once (memory being allocated: loading a model, the first batches).
GROWN = 1.03
# smaps_rollup read otherwise no more than this share of one core's time.
READ_SHARE = 0.01
CPU_SAMPLE_SECONDS = 0.05


def _cpu_of(procs: list) -> float:
    """The CPU time of a process tree so far: a process that has gone (and so been waited for)
    is in its parent's children's times."""
    import psutil

    total = 0.0
    for process in procs:
        try:
            total += _tree_cpu(process.cpu_times())
        except psutil.Error:
            continue
    return total


def _tree_cpu(times) -> float:
    """A process's CPU time with that of the children it has waited for (getrusage(2):
    RUSAGE_CHILDREN counts "all children ... that have terminated and been waited for"): summed
    over a process tree, each second is counted once, by the process or by its parent."""
    return times.user + times.system + times.children_user + times.children_system


def exit_cpu_seconds(proc) -> float | None:
    """The whole CPU time of a container this process started: read from the exited entrypoint
    before it is reaped (waitid's WNOWAIT leaves it waitable), so its step and every process it
    waited for are in. A warm-started one is the fork server's child, not ours: the server
    reaps it and sends its wait4 figure (fork_server.report_exit); None if the server died
    first (the sampled figure stands, which misses at most its last CPU_SAMPLE_SECONDS)."""
    import psutil

    if not isinstance(proc, subprocess.Popen):
        proc.wait()
        return proc.cpu_seconds
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        return _tree_cpu(psutil.Process(proc.pid).cpu_times())
    except (ChildProcessError, psutil.Error):
        return None
