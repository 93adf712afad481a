"""A job's containers played in the image itself, with a container engine (docker or podman), as
SageMaker starts them on its instances: one container per host, named after the host (`algo-1`,
`algo-2`, ...) on a network of the job's own where the others resolve it by that name, the job
root mounted as /opt/ml, `train` or the processing request's ContainerEntrypoint and
ContainerArguments, stopped with SIGTERM and killed 120 s later. The environment is the image's
ENV (the engine gives it), the request's Environment and what SageMaker sets, and the plumbing
that reaches the embedded control plane: nothing of this machine's.

The process player (processes.py `ProcessLauncher`) starts the entrypoint as processes of this
machine; this one (`ImageLauncher`) starts it with the container engine, through the same
runner (processes.py `Containers`): following the output, the deadline, the failure file and
the exit are the runner's.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.player.processes import Launch
from steps.runtime import names
from steps.runtime.names import CONTAINER_ROOT, host_path
from steps.runtime.secrets import secret_values

ENGINES = ("docker", "podman")
# Every container and network the player makes carries this label, valued `<host>:<pid>` of the
# driver that made it: a driver killed outright (SIGKILL) cannot remove its own, so the next
# one on this machine does (`sweep`).
DRIVER_LABEL = "smpipe.driver"
# Every container's hostname, as SageMaker's training hosts answer gethostname() (see _command).
SAGEMAKER_HOSTNAME = "aws"


def call(engine: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One command of the engine's client, waited for `timeout` seconds at most (an engine
    that hangs fails the call, as one that refuses it does)."""
    try:
        return subprocess.run(
            [engine, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        said = f"{engine} {args[0]}: no answer in {timeout:g} s"
        return subprocess.CompletedProcess([engine, *args], 124, "", said)


def driver_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def sweep(engine: str) -> list[str]:
    """Remove the containers and networks of drivers of this machine that are gone (killed
    before they could); the names removed."""
    import psutil

    removed = []
    kinds = (
        ("container", ["ps", "-a"], ".Config.Labels"),
        ("network", ["network", "ls"], ".Labels"),
    )
    for kind, listing, labels in kinds:
        found = call(engine, *listing, "--filter", f"label={DRIVER_LABEL}", "--format", "{{.ID}}")
        for item in found.stdout.split():
            template = f'{{{{.Name}}}} {{{{index {labels} "{DRIVER_LABEL}"}}}}'
            label = call(engine, kind, "inspect", "--format", template, item).stdout.split()
            if len(label) != 2:
                continue
            name, (host, _, pid) = label[0], label[1].rpartition(":")
            if host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid)):
                if kind == "container":  # killed at once: nothing of it is waited for
                    call(engine, "kill", item)
                if call(engine, kind, "rm", "-f", item).returncode == 0:
                    removed.append(name.lstrip("/"))
    return removed


class ImageUnavailable(RuntimeError):
    """No engine, or no such image: said before any job starts."""


def find_engine(wanted: str = "auto") -> str:
    """`docker` where its daemon answers, `podman` otherwise; or the one asked for."""
    candidates = ENGINES if wanted == "auto" else (wanted,)
    for engine in candidates:
        if shutil.which(engine) is None:
            continue
        if call(engine, "info", timeout=60).returncode == 0:
            if engine == "podman":
                network_backend_problem(engine)
            return engine
    raise ImageUnavailable(
        f"no container engine answers ({' or '.join(candidates)}): `make engine` installs "
        "podman; without --image, the emulated backend plays jobs as processes"
    )


def network_backend_problem(engine: str) -> None:
    """ImageUnavailable where podman's network backend is not netavark: its other one, CNI,
    needs plugins Debian installs apart, resolves no container by alias (algo-N), and a job's
    network made with it fails in the job and leaves its file in /etc/cni/net.d. The setting
    decides (containers.conf(5), [network] network_backend); without it podman 4.3 on Debian 12
    chose CNI here."""
    found = call(engine, "info", "--format", "{{.Host.NetworkBackend}}", timeout=60)
    backend = found.stdout.strip()
    if found.returncode == 0 and backend != "netavark":
        where = os.environ.get("CONTAINERS_CONF") or "/etc/containers/containers.conf"
        raise ImageUnavailable(
            f"podman's network backend is {backend!r}, and the jobs' containers find each other "
            f'by name on netavark\'s: set network_backend = "netavark" under [network] in {where} '
            "(docker/containers.conf holds it; `make engine` installs it where there is none)"
        )


def image_id(engine: str, image: str) -> str:
    """The image's id, or ImageUnavailable naming the image and how to build it."""
    found = call(engine, "image", "inspect", "--format", "{{.Id}}", image)
    if found.returncode != 0:
        raise ImageUnavailable(
            f"[emulated] IMAGE: {engine} has no image {image!r} (`make image` builds "
            f"smpipe:latest from docker/Dockerfile)"
        )
    return found.stdout.strip()


@dataclass(frozen=True)
class ImageRef:
    """The image a run's jobs run in, resolved once before the first job: every job runs it by
    `id`, so a tag moved meanwhile changes nothing; the run's Metadata records it."""

    name: str  # as the settings or --image named it
    id: str
    digest: str | None  # the registry's digest, for an image pulled or pushed (None: local only)
    lock_sha256: str  # of the requirements.lock it was built with (its IMAGE_RECORD_FILE)

    def record(self) -> dict:
        return asdict(self)


def resolve_image(engine: str, image: str, lock: Path | None) -> ImageRef:
    """`image` as its id, its digest and its lock, or ImageUnavailable: no such image, or one
    built from a lock other than `lock` (the checkout's requirements.lock; None where there is
    none, as in an installed smpipe), naming both hashes and how to build it anew."""
    found = image_id(engine, image)
    digests = call(engine, "image", "inspect", "--format", "{{json .RepoDigests}}", found)
    listed = json.loads(digests.stdout or "null") if digests.returncode == 0 else None
    digest = listed[0].rpartition("@")[2] if listed else None
    # The record docker/Dockerfile writes into the image, read in a container of it (a read of
    # the image's files that docker and podman both give, without mounting it here).
    reading = ["run", "--rm", "--network", "none", "--entrypoint", "cat", found]
    read = call(engine, *reading, names.IMAGE_RECORD_FILE)
    try:
        held = json.loads(read.stdout)["lock_sha256"] if read.returncode == 0 else None
    except (ValueError, KeyError, TypeError):
        held = None
    if held is None:
        raise ImageUnavailable(
            f"[emulated] IMAGE {image!r} (id {short(found)}) holds no {names.IMAGE_RECORD_FILE}: "
            "it was not built from docker/Dockerfile (`make image` builds smpipe:latest)"
        )
    wanted = hashlib.sha256(lock.read_bytes()).hexdigest() if lock and lock.is_file() else held
    if held != wanted:
        raise ImageUnavailable(
            f"[emulated] IMAGE {image!r} (id {short(found)}) was built from a requirements.lock "
            f"of sha256 {held[:12]}, and this checkout's is {wanted[:12]}: its jobs would run "
            "other packages than the lock says; `make image` builds it anew"
        )
    return ImageRef(image, found, digest, held)


def short(image: str) -> str:
    return image.removeprefix("sha256:")[:12]


def current_host(root: Path) -> str:
    """The host a job root belongs to, as its resourceconfig.json says (SageMaker writes one per
    host, job_root.py lays it out)."""
    for config in (names.RESOURCE_CONFIG_FILE, names.PROCESSING_RESOURCE_CONFIG_FILE):
        path = host_path(root, config)
        if path.exists():
            return json.loads(path.read_text())["current_host"]
    raise FileNotFoundError(f"{root} holds no resourceconfig.json: not a laid-out job root")


class Gateway:
    """The embedded control plane as the containers reach it: a TCP relay on this machine, at the
    gateway address of each job's network, to the moto server on loopback. It listens on every
    address and relays only connections from the job networks' subnets (and loopback): moto
    stays unreachable from anywhere else."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._subnets: set[ipaddress.IPv4Network] = set()
        self._server = socket.create_server(("0.0.0.0", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def allow(self, subnet: str) -> None:
        self._subnets.add(ipaddress.ip_network(subnet))

    def forbid(self, subnet: str) -> None:
        self._subnets.discard(ipaddress.ip_network(subnet))

    def _allowed(self, address: str) -> bool:
        peer = ipaddress.ip_address(address)
        return peer.is_loopback or any(peer in subnet for subnet in set(self._subnets))

    def _accept(self) -> None:
        while True:
            try:
                client, (address, _) = self._server.accept()
            except OSError:  # closed
                return
            if not self._allowed(address):
                client.close()
                continue
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return

        def pump(source: socket.socket, sink: socket.socket) -> None:
            try:
                while chunk := source.recv(1 << 16):
                    sink.sendall(chunk)
            except OSError:
                pass
            finally:
                for s in (source, sink):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
        pump(client, upstream)
        client.close()
        upstream.close()

    def close(self) -> None:
        self._server.close()


class Networks:
    """A network of each job's own while any of its containers runs (`smpipe-<job>-<id>`), as
    each SageMaker job's instances share a network no other job's are on."""

    def __init__(self, engine: str, gateway: Gateway) -> None:
        self.engine, self.gateway = engine, gateway
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, str, str, int]] = {}  # job -> name, gateway, subnet, n

    def join(self, job: str) -> tuple[str, str]:
        """The job's network (made for its first container) and its gateway address."""
        with self._lock:
            if job not in self._open:
                name = f"smpipe-{job[:40]}-{uuid.uuid4().hex[:8]}".lower()
                self._run("network", "create", "--label", f"{DRIVER_LABEL}={driver_tag()}", name)
                inspected = json.loads(self._run("network", "inspect", name))[0]
                subnet, gateway = _subnet_and_gateway(inspected)
                self.gateway.allow(subnet)
                self._open[job] = (name, gateway, subnet, 0)
            name, gateway, subnet, count = self._open[job]
            self._open[job] = (name, gateway, subnet, count + 1)
            return name, gateway

    def leave(self, job: str) -> None:
        """One of the job's containers ended; the last one's network is removed."""
        with self._lock:
            name, gateway, subnet, count = self._open[job]
            if count > 1:
                self._open[job] = (name, gateway, subnet, count - 1)
                return
            del self._open[job]
        self.gateway.forbid(subnet)
        call(self.engine, "network", "rm", "-f", name)

    def _run(self, *args: str) -> str:
        done = call(self.engine, *args)
        if done.returncode != 0:
            raise RuntimeError(f"{self.engine} {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout


def _subnet_and_gateway(inspected: dict) -> tuple[str, str]:
    """A network's first subnet and gateway, from `podman network inspect` (`subnets`) or
    `docker network inspect` (`IPAM.Config`)."""
    for subnet in inspected.get("subnets") or []:
        return subnet["subnet"], subnet["gateway"]
    for config in (inspected.get("IPAM") or {}).get("Config") or []:
        return config["Subnet"], config["Gateway"]
    raise RuntimeError(f"network {inspected.get('name') or inspected.get('Name')} has no subnet")


class ImageLauncher:
    """The containers of the jobs a backend plays, run in `ref`'s image with `engine` (a
    processes.Launcher: processes.Containers starts, follows and stops them through it).

    `plumbing(endpoint)`: what a job is given to reach the embedded control plane (the AWS
    endpoint, credentials as its role would give them), `endpoint` being the address the
    container reaches it at."""

    metered = False  # the engine's client is what runs here: the container is not a child
    # podman's network setup (netavark, aardvark-dns) says so on the container's stderr where no
    # syslog listens (seen with podman 4.3 on Debian 12): the engine's, not the job's.
    noise = frozenset({"failed to connect to syslog: Initialization"})

    def __init__(self, engine: str, ref: ImageRef, plumbing, moto_port: int) -> None:
        self.engine, self.ref, self.plumbing = engine, ref, plumbing
        self.image = ref.id  # every container: the image as resolved, not its tag
        sweep(engine)
        self.gateway = Gateway(moto_port)
        self.networks = Networks(engine, self.gateway)
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}  # pid of the engine's client -> its container

    def hosts_env(self, env: dict[str, str]) -> dict[str, str]:
        """SageMaker's hosts resolve one another: torchrun's master is `algo-1` at its default
        port, as on SageMaker (steps/runtime/launch.py)."""
        return env

    @contextmanager
    def started(self, launch: Launch) -> Iterator[tuple[subprocess.Popen, list[str]]]:
        """The host's container started by the engine's client, on the job's network (left,
        and removed after its last container, when the block ends)."""
        host = current_host(launch.root)
        network, gateway = self.networks.join(launch.job)
        name, pid = f"{network}-{host}", None
        try:
            full = {**self.plumbing(f"http://{gateway}:{self.gateway.port}"), **launch.env}
            proc = subprocess.Popen(
                self._command(name, host, network, launch, list(full)),
                # The engine's client runs with this machine's environment (its own settings:
                # CONTAINERS_CONF, DOCKER_HOST); the container gets only the --env keys.
                env={**os.environ, **full},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            pid = proc.pid
            with self._lock:
                self._names[pid] = name
            yield proc, secret_values(full)
        finally:
            with self._lock:
                self._names.pop(pid, None)
            self.networks.leave(launch.job)

    def _command(
        self, name: str, host: str, network: str, launch: Launch, variables: list[str]
    ) -> list[str]:
        """`ENGINE run` for one host's container, as SageMaker starts it."""
        command = [
            self.engine,
            "run",
            "--rm",
            "--name",
            name,
            # On SageMaker a container's hostname is `aws` on every host, never algo-N (AWS's
            # PyTorch training containers LD_PRELOAD changehostname.c to change it, "without
            # this gethostname() on SageMaker returns 'aws'": aws/deep-learning-containers);
            # the hosts reach each other as algo-N, here by network alias.
            "--hostname",
            SAGEMAKER_HOSTNAME,
            "--network",
            network,
            "--network-alias",
            host,
            "--volume",
            f"{launch.root}:{CONTAINER_ROOT}",
            "--label",
            f"{DRIVER_LABEL}={driver_tag()}",
            # podman adds TERM and `container` to every container, docker (SageMaker's) neither
            # (https://docs.podman.io/en/v4.3/markdown/podman-run.1.html, --env).
            *(["--unsetenv", "TERM", "--unsetenv", "container"] if self.engine == "podman" else []),
            # Each value from the client's environment, not the command line (`ps` shows that).
            *[flag for key in variables for flag in ("--env", key)],
        ]
        # A processing request's ContainerEntrypoint replaces the image's ENTRYPOINT and its
        # ContainerArguments follow (API_AppSpecification.html; build-your-own-processing-
        # container.html): the program as --entrypoint, the rest before the arguments
        # (docker's --entrypoint takes one program, not the exec form podman also reads).
        entrypoint, arguments = launch.entrypoint, launch.arguments
        if entrypoint:
            return [
                *command,
                "--entrypoint",
                entrypoint[0],
                self.image,
                *entrypoint[1:],
                *arguments,
            ]
        return [*command, self.image, *arguments]

    def signal(self, pid: int, signum: int) -> None:
        """`signum` to the container's PID 1, as `docker stop` / `docker kill` send it (SIGKILL:
        every process in it ends). A container still being created when the signal comes gets
        it once it exists, however long that takes on a loaded machine: the engine refuses a
        kill until then, and the client that creates it is still running (a signal given up on
        left one training on)."""
        with self._lock:
            name = self._names.get(pid)
        if name is None:
            return

        def send() -> None:
            while True:
                done = call(self.engine, "kill", "--signal", str(int(signum)), name, timeout=30)
                if done.returncode == 0:
                    return
                with self._lock:
                    if pid not in self._names:  # the client has exited: nothing to stop
                        return
                time.sleep(0.5)

        threading.Thread(target=send, daemon=True).start()

    def close(self) -> None:
        self.gateway.close()
