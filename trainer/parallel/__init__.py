"""The parallel wing: one step on many devices.

A replica (a drafter and its target on one device, replica.py), the threaded topology of worker
threads (topology.py) with its gradient exchange (exchange.py) and sharded update (sharding.py),
and the process topology under torchrun (process.py). Imports the model wing and the config.
"""
