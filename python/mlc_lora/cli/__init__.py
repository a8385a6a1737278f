"""Command-line entry points; each file only parses arguments and calls into the library."""
