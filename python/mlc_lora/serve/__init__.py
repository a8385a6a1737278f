"""`mlc_lora serve`: an OpenAI-compatible HTTP server with runtime adapter management and metrics."""

from .adapters import AdapterRoots
from .app import APIError, Server, create_app
from .run import serve

__all__ = ["APIError", "AdapterRoots", "Server", "create_app", "serve"]
