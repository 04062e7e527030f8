"""``pdserve status | head``: a reader that leaves early ends the command quietly (exit 0, nothing on
stderr), not with a BrokenPipe traceback or error line. A real pipe, a real child process."""

from __future__ import annotations

import subprocess
import sys

# A command whose output outlives its reader: `status` with its run() swapped for one that prints a lot.
CHILD = """
import sys
import cli.status
def run(args):
    for i in range(200000):
        print("worker", i, "0 running, 64/64 KV blocks free")
    return 0
cli.status.run = run
from cli.main import main
sys.exit(main(["status"]))
"""


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().startswith("worker 0")
    child.stdout.close()  # as `head -1` does once it has its line
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "BrokenPipe" not in err and "Broken pipe" not in err and "Traceback" not in err
