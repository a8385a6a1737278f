"""Command-line entry points; each file only parses arguments and calls into the library."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already speaks of it or there is
    none to show (a flag, None, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings or action.nargs == 0:
            return text
        if action.default is None or action.default is argparse.SUPPRESS or action.default == []:
            return text
        return f"{text} (default: %(default)s)"
