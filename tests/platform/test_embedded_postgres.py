"""tessera.embedded_postgres: the throwaway PostgreSQL of `make test` and the embedded one of
`make run DB=postgres` (a real server: initdb, postgres, pg_isready from the distribution)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tessera import embedded_postgres

pytestmark = pytest.mark.skipif(
    not any(
        Path(d, "initdb").exists()
        for d in [os.environ.get("PG_BIN_DIR", "/nonexistent"), *map(str, Path("/usr/lib/postgresql").glob("*/bin"))]
    ),
    reason="no PostgreSQL server installed (make postgres-server)",
)


@pytest.fixture
def server_dir():
    """A folder the server user can reach (pytest's tmp_path is private to root when we are root)."""
    folder = Path(tempfile.mkdtemp(prefix="tessera-postgres-test-"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def server(server_dir):
    url, proc = embedded_postgres.start(str(server_dir / "pg"), throwaway=True)
    yield url, proc, server_dir / "pg"
    embedded_postgres.stop(proc, server_dir / "pg")


def test_the_server_accepts_its_password_only(server):
    url, _, _ = server
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT current_database(), current_user").fetchone() == ("tessera", "tessera")
    wrong = url.replace(url.split(":")[2].split("@")[0], "wrong-password")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong).close()


def test_the_server_runs_unprivileged_and_listens_on_its_address_only(server):
    url, _, base = server
    with psycopg.connect(url) as conn:
        listen = conn.execute("SHOW listen_addresses").fetchone()[0]
        fsync = conn.execute("SHOW fsync").fetchone()[0]
    assert listen == "127.0.0.1" and fsync == "off"  # a throwaway server skips the disk flushes
    owner = (base / "data").stat().st_uid
    if os.geteuid() == 0:
        assert owner != 0 and owner == embedded_postgres.server_user().pw_uid
    assert (base / "postgres-password").stat().st_mode & 0o077 == 0  # readable by its owner alone


def test_stop_ends_the_server_and_removes_a_throwaway_folder(server_dir):
    url, proc = embedded_postgres.start(str(server_dir / "pg"), throwaway=True)
    embedded_postgres.stop(proc, server_dir / "pg")
    assert proc.poll() is not None and not (server_dir / "pg").exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2).close()


def test_a_kept_cluster_keeps_its_data_and_password_across_restarts(server_dir):
    """`make run DB=postgres`: var/postgres survives the run, as SQLite's file does."""
    url, proc = embedded_postgres.start(str(server_dir / "pg"))
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (n int)")
            conn.execute("INSERT INTO kept VALUES (42)")
    finally:
        embedded_postgres.stop(proc)
    url_again, proc = embedded_postgres.start(str(server_dir / "pg"))
    try:
        assert url_again.split("@")[0] == url.split("@")[0]  # same user and password
        with psycopg.connect(url_again) as conn:
            assert conn.execute("SELECT n FROM kept").fetchone() == (42,)
    finally:
        embedded_postgres.stop(proc, server_dir / "pg")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another user")
def test_a_folder_the_server_user_cannot_reach_is_named_before_initdb(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(RuntimeError, match="which cannot enter /"):
        embedded_postgres.prepare(private / "pg")
    assert not (private / "pg").exists()


def test_a_read_then_write_transaction_goes_through_while_another_connection_writes(server):
    """finish_reply's shape, which SQLite needed BEGIN IMMEDIATE for (test_database_settings.py): on
    PostgreSQL a transaction that reads, lets another connection commit, then writes, just commits."""
    url, _, _ = server
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute("CREATE TABLE reply (id serial PRIMARY KEY, status text)")
        setup.execute("INSERT INTO reply (status) VALUES ('streaming')")
    with psycopg.connect(url) as reader, psycopg.connect(url, autocommit=True) as other:
        assert reader.execute("SELECT status FROM reply WHERE id = 1").fetchone() == ("streaming",)
        other.execute("INSERT INTO reply (status) VALUES ('other')")
        reader.execute("UPDATE reply SET status = 'error' WHERE id = 1")
        reader.commit()
        assert other.execute("SELECT status FROM reply ORDER BY id").fetchall() == [("error",), ("other",)]


def test_select_for_update_lets_exactly_one_of_two_finishers_save_a_reply(server):
    """save_reply's lock: both finishers look for the row still streaming under FOR UPDATE; the second
    waits for the first to commit, then finds it finished (read committed re-checks the row)."""
    url, _, _ = server
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute("CREATE TABLE reply (id int PRIMARY KEY, status text)")
        setup.execute("INSERT INTO reply VALUES (1, 'streaming')")
    find = "SELECT id FROM reply WHERE id = 1 AND status = 'streaming' FOR UPDATE"
    with (
        psycopg.connect(url) as first,
        psycopg.connect(url) as second,
        psycopg.connect(url, autocommit=True) as watcher,
    ):
        assert first.execute(find).fetchone() == (1,)
        second_pid = second.info.backend_pid
        found_by_second = []
        racer = threading.Thread(target=lambda: found_by_second.append(second.execute(find).fetchone()))
        racer.start()
        wait_until(
            lambda: (
                watcher.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (second_pid,)).fetchone()
                == ("Lock",)
            )
        )
        first.execute("UPDATE reply SET status = 'complete' WHERE id = 1")
        first.commit()
        racer.join(60)
        assert found_by_second == [None]  # the second finisher sees it finished and saves nothing


def wait_until(condition, timeout: float = 60.0) -> None:
    """Poll a condition (a lock wait shows in pg_stat_activity once the backend blocks)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
