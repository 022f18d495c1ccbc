"""Command line: ``python -m torch_fsdp_ext doctor``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_fsdp_ext", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    doctor_parser = commands.add_parser("doctor", help="report what this torch needs and self-test the fixes")
    doctor_parser.add_argument("--world-size", type=int, default=2, help="ranks for the self-test (default 2)")
    args = parser.parse_args(argv)
    if args.command != "doctor":
        parser.print_help()
        return 2
    from ._doctor import doctor

    return doctor(world_size=args.world_size)


if __name__ == "__main__":
    sys.exit(main())
