"""The SQLite default database runs in WAL mode (usage rows are written per request)."""

import contextlib
import copy

import pytest
from django.db import OperationalError, connections, transaction
from django.db.backends.sqlite3.base import DatabaseWrapper


@pytest.mark.django_db
def test_a_sqlite_file_database_runs_in_wal_mode_with_normal_sync(tmp_path):
    settings_dict = copy.deepcopy(connections["default"].settings_dict)
    if settings_dict["ENGINE"] != "django.db.backends.sqlite3":
        pytest.skip("DATABASE_URL points at another database")
    settings_dict["NAME"] = str(tmp_path / "wal.sqlite3")
    wrapper = DatabaseWrapper(settings_dict, alias="wal-check")
    try:
        with wrapper.cursor() as cursor:
            assert cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert cursor.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    finally:
        wrapper.close()


def _file_database(tmp_path, **options) -> list[DatabaseWrapper]:
    """Two connections (two threads' worth) to one fresh SQLite file with the project's options."""
    settings_dict = copy.deepcopy(connections["default"].settings_dict)
    if settings_dict["ENGINE"] != "django.db.backends.sqlite3":
        pytest.skip("DATABASE_URL points at another database")
    settings_dict["NAME"] = str(tmp_path / "locks.sqlite3")
    settings_dict["OPTIONS"].update(options)
    wrappers = [DatabaseWrapper(copy.deepcopy(settings_dict), alias=f"lock-check-{i}") for i in range(2)]
    with wrappers[0].cursor() as cursor:
        cursor.execute("CREATE TABLE reply (id INTEGER PRIMARY KEY, status TEXT)")
        cursor.execute("INSERT INTO reply VALUES (1, 'streaming')")
    return wrappers


def _read_then_write(reader: DatabaseWrapper, other: DatabaseWrapper) -> None:
    """finish_reply's shape (select, then update, in one transaction) while another thread writes."""
    with transaction.atomic(using=reader.alias):
        with reader.cursor() as cursor:
            cursor.execute("SELECT status FROM reply WHERE id = 1")
        with other.cursor() as cursor:  # e.g. an SSE request recording its usage row
            cursor.execute("INSERT INTO reply (status) VALUES ('other')")
        with reader.cursor() as cursor:
            cursor.execute("UPDATE reply SET status = 'error' WHERE id = 1")


@pytest.mark.django_db
def test_a_deferred_transaction_that_reads_first_fails_at_once_when_another_connection_writes(tmp_path):
    """The cause of the playground reply left "streaming" after an engine kill (chaos suite)."""
    reader, other = _file_database(tmp_path, transaction_mode="DEFERRED")
    with _registered(reader, other), pytest.raises(OperationalError, match="locked"):
        _read_then_write(reader, other)


@pytest.mark.django_db
def test_project_transactions_take_the_write_lock_at_begin_so_the_other_writer_waits(tmp_path):
    reader, other = _file_database(tmp_path, timeout=0.2)  # the project's own transaction mode
    with _registered(reader, other):
        with pytest.raises(OperationalError, match="locked"):  # the other writer is held off...
            _read_then_write(reader, other)
        with other.cursor() as cursor:  # (a deferred reader fails instead, after the insert went in)
            assert cursor.execute("SELECT COUNT(*) FROM reply").fetchone()[0] == 1
        with transaction.atomic(using=reader.alias):  # ...and the reader's own write goes through
            with reader.cursor() as cursor:
                cursor.execute("SELECT status FROM reply WHERE id = 1")
                cursor.execute("UPDATE reply SET status = 'error' WHERE id = 1")
        with other.cursor() as cursor:
            assert cursor.execute("SELECT status FROM reply WHERE id = 1").fetchone()[0] == "error"


@contextlib.contextmanager
def _registered(*wrappers: DatabaseWrapper):
    """transaction.atomic(using=alias) looks connections up by alias."""
    for wrapper in wrappers:
        connections[wrapper.alias] = wrapper
    try:
        yield
    finally:
        for wrapper in wrappers:
            wrapper.close()
            del connections[wrapper.alias]
