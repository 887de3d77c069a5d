"""`python -m ssd <command>`. Commands: doctor.

Each command lives in its own module with a `register(subparsers)` that adds its parser
and sets `func(args) -> exit code`; add a new one to COMMANDS.
"""

import argparse
import sys

from ssd.tools import doctor

COMMANDS = (doctor,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd",
                                     description="SSD in cuTile: command-line tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for module in COMMANDS:
        module.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
