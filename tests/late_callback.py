"""A gloo collective whose Python callback is still running when the process ends (tests/test_cpu.py).

Run as `python -m late_callback` from tests/: one gloo rank starts an all_reduce whose callback, on gloo's worker
thread, sleeps 0.5 s and then needs the GIL again, while the main thread ends the script. An object freed at the
interpreter's shutdown keeps the shutdown busy for 2 s, as a trained model's teardown does, so the callback asks
for the GIL during it. Environment: ARM=1 arms plugin.cpu.exit_before_shutdown; RAISE=1 fails after arming.
"""

import atexit
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import plugin.cpu

atexit.register(print, "an earlier exit handler ran", flush=True)


class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(2)


def late(fut, sleep=time.sleep):
    print("callback running", file=sys.stderr, flush=True)  # stdout is the main thread's
    sleep(0.5)  # the GIL is released here; taking it back happens during the shutdown
    return fut.value()


store = dist.FileStore(tempfile.mktemp(prefix="late_callback_"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.all_reduce(torch.ones(1024), async_op=True).get_future().then(late)
slow = SlowTeardown()
if os.environ.get("ARM") == "1":
    plugin.cpu.activate()
    print("armed:", plugin.cpu.exit_before_shutdown(entry="late_callback"), flush=True)
if os.environ.get("RAISE") == "1":
    raise RuntimeError("the run failed after close()")
sys.stdout.write("the last line, unflushed")
