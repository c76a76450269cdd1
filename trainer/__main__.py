import time

began = time.perf_counter()  # the trainer's start: its startup breakdown counts from here

from .cli import main  # noqa: E402
from .exits import exit_process  # noqa: E402

exit_process(main(began=began))
