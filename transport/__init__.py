"""The wire: message types, the msgpack codec and the socket factory."""

from .codec import DecodeError, decode, encode, error_for
from .messages import *  # noqa: F401,F403
from .messages import __all__ as _messages_all
from .sockets import SocketOptions, make_socket

__all__ = ["DecodeError", "decode", "encode", "error_for", "SocketOptions", "make_socket", *_messages_all]
