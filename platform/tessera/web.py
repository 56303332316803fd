"""The web process: uvicorn (uvloop, httptools) serving tessera.asgi:application, HTTP and websockets.

    python -m tessera.web --host 127.0.0.1 --port 8000
    python -m tessera.web --fd 3          (accept on an inherited listening socket: WEB_PROCESSES > 1)

Chosen over daphne by CPU time per streamed token (docs/benchmarks.md, "Serving over HTTP"); WEB_SERVER=daphne
still runs daphne. `make run`, compose and the Dockerfile all start this module, so the server's
settings live here once.
"""

from __future__ import annotations

import argparse
import gc

import uvicorn

ASGI_APP = "tessera.asgi:application"
# On SIGTERM open streams get this long to finish (the engine drains meanwhile), then are closed.
GRACEFUL_SHUTDOWN_S = 10
# An idle keep-alive connection stays open longer than clients keep theirs (httpx and the openai SDK
# 5 s, aiohttp 15 s, load balancers 60 s). A server that closes first races a client's next request
# on that connection, which then fails without ever reaching the server (uvicorn's default is 5 s).
KEEP_ALIVE_S = 75
# Collector thresholds (young, middle, old): under a flood of open streams CPython's default (a young
# collection every 700 new objects) led to a full collection every few seconds, each pausing every stream
# (docs/benchmarks.md, Fair share).
GC_THRESHOLDS = (50_000, 20, 20)


def config(*, host: str, port: int, fd: int | None, proxy_headers: bool) -> uvicorn.Config:
    return uvicorn.Config(
        ASGI_APP,
        host=host,
        port=port,
        fd=fd,
        loop="uvloop",
        http="httptools",
        ws="websockets",
        lifespan="off",  # Django's ASGI handler does not speak the lifespan protocol
        # As daphne: X-Forwarded-* is believed only when asked for (behind compose's proxy), then from any peer.
        proxy_headers=proxy_headers,
        forwarded_allow_ips="*" if proxy_headers else None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fd", type=int, help="an inherited listening socket to accept on instead")
    parser.add_argument("--proxy-headers", action="store_true", help="trust X-Forwarded-For/-Proto")
    return parser.parse_args(argv)


def warm_up() -> None:
    """Set Django up, import the URLconf and load the served model's tokenizer and chat template before
    the socket opens: /health, and so make run's `ready:`, waits for them, not the first request (Django
    imports the URLconf, every view module behind it, on the first request it routes)."""
    from django.conf import settings
    from django.urls import get_resolver

    import tessera.asgi  # noqa: F401  (the app uvicorn serves: importing it sets Django up)
    from generation import tokenization

    get_resolver().url_patterns  # noqa: B018  (a cached property: reading it imports the URLconf)
    tokenization.warm_up(str(settings.MODEL))


def tune_collector() -> None:
    """Django, the tokenizer and their imports live as long as the process: out of the collector's sight,
    a collection under load walks only the open requests' objects; and collections come less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warm_up()
    tune_collector()
    uvicorn.Server(config(host=args.host, port=args.port, fd=args.fd, proxy_headers=args.proxy_headers)).run()


if __name__ == "__main__":
    main()
