"""What every app shares and none owns: Redis connections and the hostile-input rules of HTTP.

connections.py  this process's Redis connections (sync, and one async client per event loop): the one
                place a Redis client is built for settings.REDIS_URL
redis_async.py  asyncio connections whose cancellation always lands (the channel layer's and ours)
http_guards.py  byte-level rules for the machine-facing paths: size limit, valid Unicode, nesting

Plain modules, not a Django app (no models, no ready()); importing it never imports an app or tessera.
"""
