"""Child-process programs that the crash tests kill with SIGKILL (tests/test_crash.py)."""
