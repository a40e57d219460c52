"""A gloo collective whose Python callback asks for the GIL during the interpreter's shutdown (tests/test_cpu.py).

Run as `python -m late_callback` from tests/: one gloo rank starts an all_reduce whose callback, on gloo's worker
thread, says it runs and then waits without the GIL for the last exit handler, the one registered first. The main
thread holds the GIL from that handler into the shutdown, so the callback can take it back only during the
shutdown, every time. Environment: ARM=1 arms plugin.cpu.exit_before_shutdown; RAISE=1 fails after arming.
"""

import atexit
import threading

# the last exit handler: a C function, so no Python code runs (where the main thread could hand the GIL over) from
# the moment it wakes the callback to the start of the shutdown
handlers_done = threading.Lock()
handlers_done.acquire()
atexit.register(handlers_done.release)  # registered before torch's and the plugin's handlers: run after them
atexit.register(print, "an early exit handler ran")  # unflushed: what a pipe's buffer holds at the exit

import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import plugin.cpu  # noqa: E402

started = threading.Event()


def late(fut):
    if threading.current_thread() is threading.main_thread():
        return None  # the collective had finished: `then` ran the callback at once, here
    print("callback running", file=sys.stderr, flush=True)  # stdout is the main thread's
    started.set()
    handlers_done.acquire(timeout=60)  # without the GIL
    return fut.value()


store = dist.FileStore(tempfile.mktemp(prefix="late_callback_"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
for _ in range(200):  # until one collective is still running when its callback is attached (at once, unloaded)
    dist.all_reduce(torch.ones(1 << 20), async_op=True).get_future().then(late)
    if started.wait(timeout=0.1):
        break
else:
    raise RuntimeError("every collective had finished before its callback was attached")
if os.environ.get("ARM") == "1":
    plugin.cpu.activate()
    print("armed:", plugin.cpu.exit_before_shutdown(entry="late_callback"), flush=True)
if os.environ.get("RAISE") == "1":
    raise RuntimeError("the run failed after close()")
sys.stdout.write("the last line, unflushed\n")
