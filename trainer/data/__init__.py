"""The data wing: chat conversations in, token rows out.

The chat format and its loader (chat.py) and the embedded target and data set that the local
default trains on (embedded.py). Imports only the top's config and the model wing.
"""
