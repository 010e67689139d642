"""``python -m eagle3.train`` with dynamo's compile times printed at exit and, with STACK_EVERY > 0,
all-thread stack dumps every STACK_EVERY s into STACKLOG. Caution: faulthandler's watchdog dumps
crashed two of six runs on the H200 (SIGSEGV in the middle of a dump, torch 2.11 / Python 3.12):
use them to find where the time goes, not for timings."""
import atexit
import faulthandler
import os
import sys
import time

if float(os.environ.get("STACK_EVERY", "0")) > 0:
    log = open(os.environ["STACKLOG"], "w")
    faulthandler.dump_traceback_later(float(os.environ["STACK_EVERY"]), repeat=True, file=log)
t0 = time.time()
def _bye():
    try:
        import torch._dynamo.utils as u
        print("COMPILE_TIMES", u.compile_times(repr="str"), flush=True)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        print("compile_times failed", e)
    print(f"EXIT after {time.time() - t0:.1f} s", flush=True)
atexit.register(_bye)
from eagle3.train.stage import main  # noqa: E402 - after the watchdog, so the import is covered too

sys.exit(main(sys.argv[1:]))
