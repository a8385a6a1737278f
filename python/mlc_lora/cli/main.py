"""`mlc_lora SUBCOMMAND ...`: dispatch to the subcommand modules."""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "compile": "mlc_lora.cli.compile",
    "chat": "mlc_lora.cli.chat",
    "serve": "mlc_lora.cli.serve",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(f"usage: mlc_lora {{{','.join(SUBCOMMANDS)}}} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib  # pylint: disable=import-outside-toplevel

    from ..errors import MLCLoraError  # pylint: disable=import-outside-toplevel

    try:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]) or 0
    except MLCLoraError as e:
        print(f"mlc_lora {argv[0]}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
