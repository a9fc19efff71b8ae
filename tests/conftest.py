"""Root of the test tree.

pytest imports this file with the tests directory on ``sys.path`` (this tree has no
``__init__.py`` files), which is what lets every area import the shared helpers in
``tests/support`` as ``support``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    """A deployment secret (32 random bytes, hex, mode 0600) in a file of its own under
    ``tmp_path``: its path, as ``spawn_daemon(secret_file=...)`` takes it."""
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)
