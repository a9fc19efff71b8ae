"""A ucx data-plane child that dies by SIGSEGV before its hello while a counter says
so, then serves as the real one does: the fault a UCX library crash at start gives,
which the real child cannot be made to produce on demand.

``REFITD_TEST_START_CRASHES`` names a file holding how many starts are still to
crash; each crash counts it down.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from transports.ucx import worker


def run() -> int:
    counter = Path(os.environ["REFITD_TEST_START_CRASHES"])
    left = int(counter.read_text())
    if left > 0:
        counter.write_text(str(left - 1))
        ctypes.string_at(0)  # a read at address 0: SIGSEGV, as a crash inside UCX
    return worker.main(int(sys.argv[1]), int(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(run())
