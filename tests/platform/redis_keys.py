"""The engine protocol's Redis keys, for tests that watch a live stack from outside through Redis.

They come from inference.protocol itself (torch-free): the protocol has one definition.
"""
from inference.protocol import (PREFIX, TERMINAL_EVENTS, WORKERS_SET, aborted_key, decode,  # noqa: F401
                                heartbeat_key, output_stream)
