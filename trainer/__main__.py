from .cli import main
from .exits import exit_process

exit_process(main())
