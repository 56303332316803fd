"""`manage.py engine` configuration: settings < ENGINE_ARGS json < ENGINE_<NAME> variables."""

import pytest
from django.core.management.base import CommandError

from engine_client.management.commands.engine import engine_args_from_env, worker_config_from_env
from inference.config import EngineArgs

NAMES = EngineArgs.names()


def test_later_sources_win_and_values_parse_as_json():
    env = {
        "ENGINE_ARGS": '{"max_num_seqs": 8, "dtype": "float32"}',
        "ENGINE_MAX_NUM_SEQS": "64",
        "ENGINE_ENABLE_PREFIX_CACHING": "false",
        "ENGINE_DEVICE": "cpu",
    }
    args = engine_args_from_env(NAMES, env, base={"block_size": 32, "max_num_seqs": 4})
    assert args == {
        "block_size": 32,
        "max_num_seqs": 64,
        "dtype": "float32",
        "enable_prefix_caching": False,
        "device": "cpu",
    }


@pytest.mark.parametrize("env", [{"ENGINE_ARGS": '{"no_such_arg": 1}'}, {"ENGINE_ARGS": "[1, 2]"}])
def test_unknown_or_malformed_engine_args_are_refused(env):
    with pytest.raises(CommandError):
        engine_args_from_env(NAMES, env)


def test_worker_knobs_come_from_the_environment():
    config = worker_config_from_env(
        {
            "ENGINE_HEARTBEAT_TTL": "3",
            "ENGINE_MAX_INFLIGHT": "10",
            "ENGINE_WORKER_ID": "w1",
            "ENGINE_STREAM_INTERVAL": "4",
        }
    )
    assert config == {"heartbeat_ttl": 3.0, "max_inflight": 10, "worker_id": "w1", "stream_interval": 4}


def test_the_engine_process_freezes_its_start_up_heap():
    """The worker's process is its own: it may move what start-up allocated out of the collector's sight."""
    from types import SimpleNamespace

    from engine_client.management.commands.engine import Command
    from inference.worker import WorkerConfig

    llm = SimpleNamespace(llm_engine=SimpleNamespace(max_model_len=64))
    config = Command().build_worker(llm, "tiny", {}, {}, None, lambda engine, client, config: config, WorkerConfig)
    assert config.freeze_heap and config.extra_info["model_path"] == "tiny"
