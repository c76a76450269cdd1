import os
import sys

from .cli import main

code = main()
if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
    # A rank under torchrun ends here without the interpreter's teardown: its files are closed and
    # its process group destroyed, and tearing down torch and gloo after that now and then aborted
    # ("terminate called without an active exception", exit -6) when another host's rank had
    # just exited; torchrun then reported a failed rank after a clean stop, and the other hosts'
    # torchruns waited for it in their exit barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
