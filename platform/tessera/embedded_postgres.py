"""Start a real PostgreSQL server (the distribution's binaries) for `make test` and `make run DB=postgres`,
the way tessera.embedded_redis starts Redis: a data folder of its own, a free port, a password.

initdb and postgres refuse to run as root, so when this process is root they run as the `postgres`
system user (else `nobody`) through runuser, and the server's folder is handed to that user.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tessera.embedded_redis import free_port
from tessera.private_files import read_or_create_secret

SUPERUSER = "tessera"
DATABASE = "tessera"
# A throwaway test server never needs to survive a power cut: skipping fsync makes each test's
# CREATE/TRUNCATE/COMMIT a memory write instead of a disk flush.
THROWAWAY_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
SERVER_USERS = ("postgres", "nobody")  # who runs the server when this process is root


def server_bin_dir() -> Path:
    """PG_BIN_DIR, else the newest Debian-style /usr/lib/postgresql/<version>/bin, else initdb on PATH."""
    candidates = [os.environ["PG_BIN_DIR"]] if os.environ.get("PG_BIN_DIR") else []
    versioned = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(
        versioned, key=lambda d: int(Path(d).parent.name) if Path(d).parent.name.isdigit() else 0, reverse=True
    )
    if shutil.which("initdb"):
        candidates.append(str(Path(shutil.which("initdb")).parent))
    for candidate in candidates:
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "postgres").exists():
            return Path(candidate)
    raise RuntimeError(
        "no PostgreSQL server found (initdb, postgres): `apt-get install postgresql`, "
        "set PG_BIN_DIR, or set DATABASE_URL"
    )


def server_user() -> pwd.struct_passwd | None:
    """The unprivileged account the server runs as when we are root; None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(f"running as root and none of the users {SERVER_USERS} exists to run PostgreSQL as")


@dataclass
class Layout:
    """One server's folder: the password file, the cluster (`data/`), the unix socket and the log."""

    base: Path

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def password_file(self) -> Path:
        return self.base / "postgres-password"

    @property
    def log(self) -> Path:
        return self.base / "postgres.log"

    def password(self) -> str:
        return read_or_create_secret(self.password_file, 24)


def url(host: str, port: int, password: str, database: str = DATABASE) -> str:
    return f"postgres://{SUPERUSER}:{password}@{host}:{port}/{database}"


def prepare(base: Path) -> Layout:
    """Make base's cluster once (initdb, password authentication only); later calls reuse it."""
    layout = Layout(Path(base).resolve())
    user = server_user()
    if user is not None:
        _check_reachable(layout.base, user)
    layout.base.mkdir(parents=True, exist_ok=True)
    layout.password()
    if user is not None:  # the server's own files belong to the account that runs it
        for path in (layout.base, layout.password_file):
            os.chown(path, user.pw_uid, user.pw_gid)
    os.chmod(layout.base, 0o700)
    if not (layout.data / "PG_VERSION").exists():
        _run_as_server_user(
            [
                str(server_bin_dir() / "initdb"),
                "-D",
                str(layout.data),
                "-U",
                SUPERUSER,
                f"--pwfile={layout.password_file}",
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
                "--no-instructions",
            ]
        )
        # initdb admits loopback only; `make cluster` connects from the other hosts of its subnet.
        # The server still listens on the one address it is given, and every login needs the password.
        with open(layout.data / "pg_hba.conf", "a") as hba:
            hba.write("host all all samenet scram-sha-256\n")
    return layout


def _check_reachable(base: Path, user: pwd.struct_passwd) -> None:
    """The server user must be able to enter every folder above base; say which one it cannot."""
    for parent in reversed(base.parents):
        info = parent.stat()
        if not (info.st_mode & stat.S_IXOTH or info.st_uid == user.pw_uid):
            raise RuntimeError(
                f"PostgreSQL runs as {user.pw_name}, which cannot enter {parent} (mode "
                f"{stat.filemode(info.st_mode)}): put its folder ({base}) somewhere it can reach"
            )


def server_command(layout: Layout, host: str, port: int, throwaway: bool = False) -> list[str]:
    """postgres's argv: listening on host:port only (and a unix socket in its own folder)."""
    settings = {
        "listen_addresses": host,
        "port": str(port),
        "unix_socket_directories": str(layout.base),
        "max_connections": "200",
        **(THROWAWAY_SETTINGS if throwaway else {}),
    }
    argv = [str(server_bin_dir() / "postgres"), "-D", str(layout.data)]
    for name, value in settings.items():
        argv += ["-c", f"{name}={value}"]
    return as_server_user(argv)


def as_server_user(argv: list[str]) -> list[str]:
    """argv run as the unprivileged server user when we are root (runuser), else as it is."""
    user = server_user()
    return ["runuser", "-u", user.pw_name, "--", *argv] if user is not None else argv


def wait_until_ready(
    host: str, port: int, proc: subprocess.Popen, timeout: float = 60.0, log: Path | None = None
) -> None:
    """Until pg_isready says the server accepts connections (it refuses them while it starts up)."""
    deadline = time.monotonic() + timeout
    ready = [str(server_bin_dir() / "pg_isready"), "-q", "-h", host, "-p", str(port), "-t", "1"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"postgres exited with code {proc.returncode}\n{tail}")
        if subprocess.run(ready, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"postgres did not accept connections on {host}:{port} within {timeout}s")


def create_database(host: str, port: int, password: str, name: str = DATABASE) -> None:
    """CREATE DATABASE name unless it exists (the cluster starts with `postgres` only)."""
    import psycopg

    with psycopg.connect(url(host, port, password, "postgres"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')


def start(
    base: str | None = None, *, host: str = "127.0.0.1", port: int | None = None, throwaway: bool = False
) -> tuple[str, subprocess.Popen]:
    """Start postgres for base's cluster (made on first use); returns (DATABASE_URL, process). Stopped
    at interpreter exit; a throwaway server's folder (a temporary one when base is None) is removed then."""
    base_dir = Path(base) if base else Path(tempfile.mkdtemp(prefix="tessera-postgres-"))
    layout = prepare(base_dir)
    port = port or free_port()
    with open(layout.log, "ab") as log:
        proc = subprocess.Popen(
            server_command(layout, host, port, throwaway), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    atexit.register(stop, proc, layout.base if throwaway else None)
    wait_until_ready(host, port, proc, log=layout.log)
    create_database(host, port, layout.password())
    return url(host, port, layout.password()), proc


def stop(proc: subprocess.Popen, remove: Path | None = None) -> None:
    """Fast shutdown (SIGINT to the server's process group: roll back open transactions, then exit
    cleanly); SIGKILL after 10 s."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def ensure_test_database() -> str | None:
    """The test session's DATABASE_URL: the env's, or (TESSERA_DB=postgres) a throwaway server started
    now and exported to child processes; None keeps the SQLite default."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    if os.environ.get("TESSERA_DB", "sqlite") != "postgres":
        return None
    database_url, _ = start(throwaway=True)
    os.environ["DATABASE_URL"] = database_url
    return database_url


def _run_as_server_user(argv: list[str]) -> None:
    done = subprocess.run(as_server_user(argv), capture_output=True, text=True, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
