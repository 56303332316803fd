"""Engine client: the one module Django code uses to reach the engine workers.

Use `from engine_client import client as engine` then engine.submit / stream / astream / abort /
collect / health / workers; see engine_client/client.py and docs/protocol.md.
"""
