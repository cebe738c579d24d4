"""`tensorwire info`: which UCX is loaded, its transports, the configuration."""

from __future__ import annotations

import argparse

from .. import TRANSPORTS


def register(commands) -> None:
    p = commands.top.add_parser("info", help="show the UCX in use, its transports and the configuration")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="exit 1 unless this transport is usable here (the table says why not)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import json

    from ..info import collect, render

    data = collect(args.transport)
    print(json.dumps(data, indent=1) if args.json else render(data))
    return 1 if args.transport != "auto" and data["usable"].get(args.transport) else 0
