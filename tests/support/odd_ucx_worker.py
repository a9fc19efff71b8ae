"""A ucx data-plane child that misbehaves before its hello as ``REFITD_TEST_CHILD``
says, then (if it gets there) serves as the real one does:

- ``chatty``: writes one line of 256 KiB (past the daemon's line limit), then 4 MiB
  of short lines (far past a pipe's buffer), then says hello. Its output must keep
  being read, or it blocks on a write and never says hello.
- ``silent``: never says hello (a UCX context that hangs while it is made).

The faults a UCX library's own output and hangs give, which the real child cannot be
made to produce on demand.
"""

from __future__ import annotations

import os
import sys
import time

from transports.ucx import worker


def run() -> int:
    mode = os.environ["REFITD_TEST_CHILD"]
    if mode == "silent":
        time.sleep(3600)
    if mode == "chatty":
        out = sys.stdout
        out.write("x" * (256 << 10) + "\n")
        for i in range(64 << 10):
            out.write(f"chatty line {i:08d} {'-' * 40}\n")
        out.write("chatty: done\n")
        out.flush()
    return worker.main(int(sys.argv[1]), int(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(run())
