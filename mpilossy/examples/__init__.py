"""Runnable examples of mpilossy (``python -m mpilossy.examples.<name>``)."""
