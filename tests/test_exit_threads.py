"""No thread of ours is left running when the interpreter finalizes: a daemon thread that wakes
then is killed inside the runtime (pthread_exit), which aborts the process with "terminate called
without an active exception" when that unwinds through C++ code."""

import subprocess
import sys

SCRIPT = """
import atexit, threading

def report():   # registered first, so it runs last: after localheap's own exit handlers
    print("ALIVE", sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))

atexit.register(report)
import localheap
from localheap.heap.recall import PageWriter
from tqdm import tqdm

writers = [PageWriter() for _ in range(4)]
for w in writers:
    w.submit(lambda: None)
    w.drain()                       # idle: its thread would wait 5 s more for work
for _ in tqdm(range(3), disable=False):   # a bar, as transformers' loading bars are
    pass
"""


def test_page_threads_and_tqdm_monitor_end_before_exit():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ALIVE []" in out.stdout, out.stdout
