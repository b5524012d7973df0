"""The protocol core: what kvferry's control plane decides, with no I/O inside.

The bottom of the control plane, below every module that touches a socket, a thread, a clock or a transport.
Nothing here imports ``zmq``, ``threading``, ``time``, ``os``, ``secrets``, ``random``, ``nixl`` or
``kvferry.transport`` (an import-linter contract in pyproject.toml says so): every time is a ``now``
passed in, every random value (a session id, a nonce) is chosen by the caller, so the same inputs give the
same decisions, in a test on a fake clock or in a simulator that drives many peers in one thread.

* ``states``: request, session and link states as enums with their transition tables; a transition the
  table does not allow is an ``InternalError`` (a kvferry bug), never a peer's bad message.
* ``timers``: when a peer is due a heartbeat, when its silence makes it lost, when our own silence means
  it has given up on us, and when a request's deadline passes; each answers the next time it needs a tick.
"""
