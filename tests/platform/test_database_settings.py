"""The SQLite default database runs in WAL mode (usage rows are written per request)."""
import copy

import pytest
from django.db import connections
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
