import pytest

from engine_client import client as engine


@pytest.fixture(autouse=True)
def fresh_workers_snapshot():
    """The API reads live workers through a 1 s snapshot; tests fake and kill workers faster than that."""
    engine.client().forget_workers_snapshot()
    yield
    engine.client().forget_workers_snapshot()
