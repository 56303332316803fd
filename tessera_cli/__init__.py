"""The `tessera` command (the console script pyproject.toml installs).

    tessera                      what it can do
    tessera serve [MODEL] ...    the whole stack on MODEL, as `make run MODEL=...` starts it

`serve` takes the engine's arguments as flags, generated from inference.config.EngineArgs (one
list: a field added there is a flag here), and hands them to the engine worker as ENGINE_<NAME>
variables, which `manage.py engine` reads over any ENGINE_ARGS; then it runs platform/tessera/run.py
in this process. It needs the source tree beside it (an editable install, as `make install` and
the Dockerfile make), because the platform is not a package.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
PLATFORM_DIR = REPO_DIR / "platform"
RUN_ENV = {"host": "HOST", "port": "PORT"}  # tessera.run's own settings that serve takes as flags
COMMANDS = {"serve": "start the whole stack (Redis, database, engine worker, Celery, web) on a model"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Tessera: a self-hosted LLM serving platform over its own engine.",
        epilog="`tessera serve --help` lists the engine arguments.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help=COMMANDS["serve"],
        description=(
            "Start the whole stack on MODEL, as `make run MODEL=...` does (PORT, HOST, REDIS_URL, DATABASE_URL... "
            "from the environment as there; Ctrl-C stops everything). Engine arguments are inference EngineArgs "
            "fields, given as flags here (default: the engine's, or ENGINE_ARGS / ENGINE_<NAME>)."
        ),
    )
    serve_parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face model folder or a .gguf file (default: MODEL, else the bundled "
        "SmolLM2-135M-Instruct GGUF)",
    )
    serve_parser.add_argument("--host", default=argparse.SUPPRESS, help="address to listen on (HOST, 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, default=argparse.SUPPRESS, help="port (PORT, 8000)")
    add_engine_flags(serve_parser.add_argument_group("engine arguments (inference.config.EngineArgs)"))
    return parser


# ---------------------------------------------------------------- engine flags from EngineArgs


def engine_fields() -> list[tuple[str, type, object, str]]:
    """(name, type, default, comment) of every EngineArgs field but the model."""
    from inference.config import EngineArgs  # imports torch: only when the flags are needed

    hints = typing.get_type_hints(EngineArgs)
    comments = field_comments(EngineArgs)
    return [
        (f.name, hints[f.name], None if f.default is MISSING else f.default, comments.get(f.name, ""))
        for f in fields(EngineArgs)
        if f.name != "model"
    ]


def field_comments(cls) -> dict[str, str]:
    """The `# ...` comment after each field in the class's source: the flag's help."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found = re.finditer(r"^\s+(\w+): [^=\n]+= [^#\n]+#\s*(.+)$", source, re.MULTILINE)
    return {match.group(1): match.group(2).strip() for match in found}


def base_type(hint) -> type:
    """int for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def add_engine_flags(group) -> None:
    for name, hint, default, comment in engine_fields():
        kind = base_type(hint)
        flag = "--" + name.replace("_", "-")
        help_text = f"{comment + '; ' if comment else ''}default: {default}".replace("%", "%%")
        if kind is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        elif kind in (int, float, str):
            group.add_argument(
                flag, dest=name, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(), help=help_text
            )
        else:  # a dict or list field (speculative decoding's config): JSON
            group.add_argument(
                flag, dest=name, type=json_value, default=argparse.SUPPRESS, metavar="JSON", help=help_text
            )


def json_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None


def serve_env(args: argparse.Namespace, env: dict | None = None) -> dict[str, str]:
    """The environment tessera.run starts the stack with: MODEL, HOST/PORT and one ENGINE_<NAME>
    (JSON, as `manage.py engine` parses it) per engine flag given; flags the user left out stay unset."""
    out = dict(os.environ if env is None else env)
    given = vars(args)
    if given.get("model"):
        out["MODEL"] = given["model"]
    for name, variable in RUN_ENV.items():
        if name in given:
            out[variable] = str(given[name])
    for name, *_ in engine_fields():
        if name in given:
            out[f"ENGINE_{name.upper()}"] = json.dumps(given[name])
    if "served_model_name" in given:  # the web tier's name for the configured model, too
        out["SERVED_MODEL_NAME"] = given["served_model_name"]
    return out


def serve(args: argparse.Namespace) -> int:
    if not (PLATFORM_DIR / "tessera" / "run.py").is_file():
        raise SystemExit(
            f"tessera serve needs the Tessera source tree at {REPO_DIR} (install it with "
            "`pip install -e .`, as `make install` does)"
        )
    os.environ.update(serve_env(args))
    sys.path[:0] = [str(REPO_DIR), str(PLATFORM_DIR)]
    from tessera import run  # platform/tessera: the same supervisor `make run` starts

    return run.main()
