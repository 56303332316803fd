"""Engine client: the one module Django code uses to reach the engine workers.

`from engine_client import client as engine`, then `engine.client()` (sync) or `engine.aclient()`
(async, per event loop): submit / stream / collect / abort / workers / health. The protocol
itself (keys, typed messages) is inference/protocol.py; see docs/protocol.md.
"""
