"""DFlash drafter trainer (python -m trainer)."""
