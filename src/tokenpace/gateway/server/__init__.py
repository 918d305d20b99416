"""The HTTP surface: the ASGI application, its routes, start-up, reload and shutdown, the
proxied request's way through the stages (``_proxy.handle``), and the worker processes.
"""

from ._app import Gateway, create_app
from ._main import load_or_exit, main, serve

__all__ = [
    "create_app",
    "Gateway",
    "load_or_exit",
    "main",
    "serve",
]
