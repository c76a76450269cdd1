"""The run wing: a training run from start to end.

The loop (train.py), exact resume (resume.py) and checkpoints (checkpoint.py), the output's lock
and run record (runrecord.py), events and notices (events.py), metrics and logs (sinks.py), the
recompile watch (recompiles.py) and the machine check (environment.py). Imports the data,
parallel and model wings and the config; the entry points above import it.
"""
