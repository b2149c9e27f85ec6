"""A process that waits until it is signalled (``python -m tests.support.idle_process``)."""

import signal

signal.pause()
