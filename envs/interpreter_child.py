"""The main of an env process run by another Python interpreter (envs/launch.py):
``python -m envs.interpreter_child FD``, with ``FD`` its end of a socket pair to the parent.

It reads what to serve (the arguments of :func:`envs.subproc_child.serve` after the connection: the
picklable env factory, its env indices, the shared-memory names and shapes, its slice), then serves.
Like envs/subproc_child.py it imports numpy and no torch: the interpreter may have neither torch
nor our other dependencies, only the simulator's.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection

from envs.subproc_child import serve


def main(fd: int) -> None:
    connection = Connection(fd)
    try:
        serve_args = connection.recv()
    except EOFError:  # the parent is gone before saying anything
        return
    except Exception:  # the factory does not unpickle here (a module this interpreter cannot import)
        connection.send(("error", traceback.format_exc()))
        return
    # attached, not created, here: the parent owns the blocks, and this interpreter's resource tracker must
    # not unlink them when this process exits (a restarted process could no longer attach)
    serve(connection, *serve_args, untrack_shared_memory=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
