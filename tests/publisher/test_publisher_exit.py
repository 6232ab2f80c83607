"""Publishes in flight when a trainer's interpreter exits, or when it leaves a ``with Publisher`` on an error, are
finished or said lost, never dropped in silence.

One real child Python process (a trainer script) serves every test here: it leaves four publishers behind
with work in flight, then dies of an uncaught RuntimeError raised inside a ``with Publisher(...)`` block:

- ``a``: three ``wait=False`` publishes, no ``close()`` (the issue's trainer: its third was lost, the
  uploads it still had to schedule refused by the interpreter's shut-down thread pools, exit status 0);
- ``b``: a ``wait=False`` publish that failed in the background (its temp dir could not be created), the error
  never raised to the script;
- ``c``: a ``wait=False`` publish whose upload does not return until the publisher has given up on it at
  exit (``exit_timeout=1``): given up on, it must commit nothing afterwards;
- ``d``: three ``wait=False`` publishes, then the RuntimeError inside its with-block;

and forks a child process (as a DataLoader does) that ends while ``b`` and ``c`` have something to say.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ckptdelta.delta.storage import Store
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher.runs import committed_versions
from tests.publisher_helpers import assert_same, perturb, weights
from tests import REPO

pytestmark = pytest.mark.timeout(300)


TRAINER = r'''
import concurrent.futures.thread, logging, os, sys, tempfile, threading
from concurrent.futures import wait

# Each publish left in flight waits in a storage call until the publisher says what it does with it (its log
# line), or else until the interpreter's exit begins: this hook, registered after concurrent.futures' own and
# before the publisher's, runs after the publisher's and before the thread pools are shut down (threading
# runs its exit hooks last registered first).
exiting = threading.Event()
threading._register_atexit(exiting.set)

import torch
from ckptdelta.publisher import Publisher
from tests.publisher_helpers import perturb, weights

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
base = sys.argv[1]


def big(step):
    w = {**weights(), "big.w": torch.arange(1 << 22, dtype=torch.float32).reshape(1024, -1).to(torch.bfloat16)}
    for s in range(step):
        perturb(w, seed=s)
    return w


def publisher(name, **kw):
    return Publisher(os.path.join(base, name), codec="fast", progress=False, **kw)


class Said(logging.Handler):
    """Sets an event when the publisher of ``run`` logs a line containing ``text``."""

    def __init__(self, run, text):
        super().__init__()
        self.run, self.text, self.event = f"/{run}:", text, threading.Event()
        logging.getLogger("ckptdelta.publisher").addHandler(self)

    def emit(self, record):
        if self.run in record.getMessage() and self.text in record.getMessage():
            self.event.set()


def stall(pub, method, said, when=lambda *a: True):
    """``pub.store.<method>`` waits (where ``when`` holds) for ``said`` or for the exit to begin."""
    real = getattr(pub.store, method)

    def stalled(*args, **kw):
        if when(*args):
            while not (said.event.wait(0.05) or exiting.is_set()):
                pass
        return real(*args, **kw)
    setattr(pub.store, method, stalled)


# b: a publish that fails in the background; its error is never raised to this script
b = publisher("b")
b.publish(big(0), 0)
tempfile.tempdir = os.path.join(base, "gone")
wait([b.publish(big(1), 1, wait=False)])
tempfile.tempdir = None

# c: a publish whose upload returns only once the publisher has given up on it
c = publisher("c", exit_timeout=1)
c.publish(big(0), 0)
stall(c, "put_file", Said("c", "given up on"))
c.publish(big(1), 1, wait=False)

# a forked child (a DataLoader worker, say) that ends while b's failure is unreported and c's publish in flight:
# they are the parent's, not the child's to finish or report
import multiprocessing
child = multiprocessing.get_context("fork").Process(target=int)
child.start()
child.join()
print(f"forked child exited with {child.exitcode}", file=sys.stderr)

# d: a with-block left on an error while its third publish is in flight (it commits only once the block is left)
with publisher("d") as d:
    leaving = Said("d", "the with-block was left")
    close = d.close
    d.close = lambda: (leaving.event.set(), close())      # an __exit__ that closes is leaving too
    stall(d, "put_if_absent", leaving, lambda key, *_: key.endswith("00000002.json"))
    for step in range(3):
        d.publish(big(step), step, wait=False)

    # a: the issue's trainer: three publishes, no close(); the third commits only once the exit has begun
    a = publisher("a")
    stall(a, "put_if_absent", Said("a", "the interpreter exits"), lambda key, *_: key.endswith("00000002.json"))
    for step in range(3):
        a.publish(big(step), step, wait=False)
    raise RuntimeError("the trainer failed")
'''


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    base = tmp_path_factory.mktemp("exit")
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-c", TRAINER, str(base)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=240)
    return base, p


def _truth(step: int) -> dict:
    import torch

    w = {**weights(), "big.w": torch.arange(1 << 22, dtype=torch.float32).reshape(1024, -1).to(torch.bfloat16)}
    for s in range(step):
        perturb(w, seed=s)
    return w


def _versions(base, name: str) -> list[int]:
    return committed_versions(Store.from_url(str(base / name)))


def _line(stderr: str, pattern: str) -> str:
    found = [ln for ln in stderr.splitlines() if re.search(pattern, ln)]
    assert found, f"no log line matches {pattern!r}:\n{stderr[-6000:]}"
    return found[0]


def test_publishes_in_flight_at_interpreter_exit_are_committed_and_logged_naming_their_versions(trainer):
    base, p = trainer
    assert _versions(base, "a") == [0, 1, 2], p.stderr[-6000:]
    reader = SnapshotReader(str(base / "a"))
    assert_same(reader.read_tensors(2), _truth(2))
    _line(p.stderr, r"^WARNING run \S+ at \S+/a: 1 publish\(es\) in flight \(step 2 \(version 2\)\) when the interpreter "
                    r"exits without Publisher.close\(\); finishing them")
    _line(p.stderr, r"^INFO run \S+ at \S+/a: step 2 \(version 2\) committed as v00000002 \(delta\) when the "
                    r"interpreter exits")


def test_a_background_failure_never_raised_to_the_trainer_is_logged_at_exit_as_an_error_naming_the_version(
        trainer):
    base, p = trainer
    assert _versions(base, "b") == [0]
    _line(p.stderr, r"^ERROR run \S+ at \S+/b: step 1 \(version 1\) was not published \(PublishError: step 1 \(version 1\) .*FileNotFoundError: .*gone")


def test_a_publish_still_running_past_exit_timeout_is_logged_as_given_up_and_commits_nothing_after(trainer):
    base, p = trainer
    _line(p.stderr, r"^ERROR run \S+ at \S+/c: step 1 \(version 1\) was not committed: still running 1s after the "
                    r"interpreter exits")
    assert _versions(base, "c") == [0]          # its upload returned after that: it did not commit


def test_a_forked_child_that_exits_leaves_the_parents_publishes_to_the_parent(trainer):
    _base, p = trainer
    assert "forked child exited with 0" in p.stderr
    assert len(re.findall(r"/b: step 1 \(version 1\) was not published", p.stderr)) == 1, p.stderr[-6000:]
    assert len(re.findall(r"/c: 1 publish\(es\) in flight", p.stderr)) == 1, p.stderr[-6000:]


def test_leaving_a_with_block_on_an_error_finishes_the_publishes_in_flight_and_lets_the_error_go_on(trainer):
    base, p = trainer
    assert p.returncode == 1 and "RuntimeError: the trainer failed" in p.stderr
    assert _versions(base, "d") == [0, 1, 2]
    assert_same(SnapshotReader(str(base / "d")).read_tensors(2), _truth(2))
    warned = _line(p.stderr, r"^WARNING run \S+ at \S+/d: 1 publish\(es\) in flight \(step 2 \(version 2\)\) when the "
                             r"with-block was left on RuntimeError")
    committed = _line(p.stderr, r"^INFO run \S+ at \S+/d: step 2 \(version 2\) committed")
    lines = p.stderr.splitlines()
    assert lines.index(warned) < lines.index(committed) < next(
        i for i, ln in enumerate(lines) if "RuntimeError: the trainer failed" in ln)
