"""Storage faults: publishes and hot-loads through a proxy that throttles, resets, stalls and truncates.

tests/faultproxy.py sits between s3fs and the moto S3 server. The clients
below it are set to one attempt with a 1 s read timeout, so every injected
fault reaches the Store, whose retries must carry each publish and hot-load
through, or fail it with an error naming the object. Whatever happens:

* every committed snapshot is exactly the weights published for it (checked
  afterwards by a reader that bypasses the proxy: ``read_tensors`` bit-exact
  and ``verify``);
* the replica (a HotSwapper over a live state dict, reading through the proxy)
  never serves half-applied weights: a thread inside ``gate.serving()`` keeps
  hashing the live tensors, and they always equal one committed version's bits,
  a version that never goes backwards.

Figures are printed (``pytest -s``); the tests assert zero corruptions.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from delta import digest
from delta.errors import CkptDeltaError, ConcurrentPublisherError, StorageError
from delta.manifest import manifest_key
from delta.storage import RetryPolicy, Store
from loader.hotswap import HotSwapper
from loader.reader import SnapshotReader
from publisher import Publisher
from tests.crashers.publish_loop import CONFIG, SHARD_BYTES, weights_for
from tests.faultproxy import FaultProxy, s3_options_through

SEED = 7
#: An error the user can act on names the object (or the snapshot) it is about.
NAMES_OBJECT = re.compile(r"(anchors|deltas|manifests)/|HEAD|RUN\.json|v\d{8}|version \d+")


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint, seed=SEED, stall_s=2.0) as p:
        yield p


def _fingerprint(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(digest(tensors[n]) for n in sorted(tensors))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return _fingerprint(a) == _fingerprint(b) and sorted(a) == sorted(b)


def test_a_commit_whose_answer_is_lost_and_resent_by_the_http_client_is_recognised_as_ours(s3_root, proxy):
    """Regression: the manifest PUT lands, the connection drops before the answer, and aiohttp resends
    the PUT itself (it does so once for an idempotent method on a reused connection). The resend gets
    412 and surfaced as ObjectExistsError, which the commit reported as another publisher's commit
    (ConcurrentPublisherError) although the manifest holds exactly our bytes."""
    url, base = s3_root
    opts = s3_options_through(proxy.url, base)
    pub = Publisher(url, storage_options=opts, progress=False)
    pub.publish(weights_for(SEED, 0), 0)
    pub.publish(weights_for(SEED, 1), 10)   # connections are warm and kept alive
    proxy.inject("reset", after=True, match=lambda m, p: m == "PUT" and "/manifests/" in p)
    r = pub.publish(weights_for(SEED, 2), 20)
    assert r.version == 2 and proxy.snapshot().get("reset") == 1
    r = pub.publish(weights_for(SEED, 3), 30)            # the publisher carries on
    assert r.version == 3
    pub.close()
    reader = SnapshotReader(url, storage_options=base)
    for v in range(4):
        assert _same(reader.read_tensors(v), weights_for(SEED, v))
