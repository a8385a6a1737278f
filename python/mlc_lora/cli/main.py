"""`mlc_lora COMMAND ...`: dispatch to the command modules (each parses its own options)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..errors import MLCLoraError

# name -> (module, one line for `mlc_lora --help`)
COMMANDS = {
    "compile": ("mlc_lora.cli.compile", "compile a model (embedded name, HF folder, .gguf) into a folder"),
    "chat": ("mlc_lora.cli.chat", "chat on the terminal, on the base model or through a LoRA adapter"),
    "serve": ("mlc_lora.cli.serve", "run the OpenAI-compatible server (many adapters over one base model)"),
}


def parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="mlc_lora", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="mlc_lora [-h] [--version] COMMAND [ARGS ...]",
        description="mlc-lora: a compiled multi-LoRA serving runtime on Apache TVM.",
        epilog=f"commands:\n{listing}\n\n`mlc_lora COMMAND --help` describes a command's options.")
    p.add_argument("--version", action="version", version=f"mlc_lora {__version__}")
    p.add_argument("command", metavar="COMMAND", help=argparse.SUPPRESS)
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        p.print_help(sys.stderr)
        return 2
    a = p.parse_args(argv)
    if a.command not in COMMANDS:
        p.error(f"unknown command {a.command!r}; the commands are: {', '.join(COMMANDS)}")
    try:
        return importlib.import_module(COMMANDS[a.command][0]).main(a.args) or 0
    except MLCLoraError as e:
        print(f"mlc_lora {a.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
