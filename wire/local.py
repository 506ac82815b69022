"""Where a node's daemon listens for its local workers, when nobody says otherwise.

The user's runtime directory (``$XDG_RUNTIME_DIR``, private to the user: systemd makes it 0700)
if there is one, else a directory of the user's own in the temporary directory,
``decentd-<uid>``, which the daemon creates with mode 0700 and refuses to use when another user
owns it or may write into it (anyone may create names in /tmp: a socket there could be squatted
or replaced).
"""

from __future__ import annotations

import os
import tempfile

#: the socket's name in its directory
SOCKET_NAME = "decentd.sock"


def private_tmp_dir() -> str:
    """This user's directory in the temporary directory."""
    return os.path.join(tempfile.gettempdir(), f"decentd-{os.getuid()}")


def default_socket() -> str:
    """The daemon's default Unix socket for this user."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.path.isdir(runtime) else private_tmp_dir()
    return os.path.join(base, SOCKET_NAME)
