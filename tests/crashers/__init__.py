"""Child-process programs that the crash tests kill with SIGKILL (tests/publisher/test_crash.py)."""
