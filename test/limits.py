"""One home for the tests' subprocess timeouts.

A timeout here catches a hang, not a slow machine: ``HANG_TIMEOUT_S`` is
several times the longest any single subprocess of the suite takes on an idle
2-core machine (about 5 minutes: the patched pytorch/xla test file), so a busy
machine (measured: 3x slower) still passes, and a hang still fails the test.
"""

HANG_TIMEOUT_S = 1800
