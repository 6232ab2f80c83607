"""ckptdelta.loader.heap: a started replica's objects are frozen out of the garbage collector's scans."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_started_replicas_heap_is_frozen_and_what_it_makes_later_is_still_collected():
    # in a process of its own: freezing this test process's heap would keep every later test's garbage cycles
    code = textwrap.dedent("""
        import gc, weakref
        from ckptdelta.loader.heap import freeze_started_heap, unfreeze_heap

        class Node:
            pass

        kept = [Node() for _ in range(1000)]
        frozen = freeze_started_heap()
        assert frozen >= 1000 and gc.get_freeze_count() == frozen, frozen
        a, b = Node(), Node()
        a.other, b.other = b, a          # a cycle made after the start
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None            # collected: only what was alive at the freeze is skipped
        unfreeze_heap()
        assert gc.get_freeze_count() == 0
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
