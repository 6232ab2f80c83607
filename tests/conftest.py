"""Shared pytest fixtures. Each section belongs to one area; add new sections below."""

from __future__ import annotations

import os
import uuid

# gcsfs reads this at import time; with the default ("true") every call first
# probes the bucket over gRPC and waits out a timeout against the emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# The replica's background warm-up (delta/warmup.py) would run codec calls on a thread of its own in the
# middle of whatever test follows the first HotSwapper, which tests that count or trace those calls
# would see. It is off in the suite (and the processes it starts) except where tests/delta/test_warmup.py
# turns it on for the processes it starts.
os.environ["CKPTDELTA_WARMUP"] = "0"

import pytest  # noqa: E402

from tests.servers import (  # noqa: E402
    S3_TEST_CREDENTIALS,
    start_fake_gcs_server,
    start_moto_server,
)

# =============================================================================
# Storage backends (delta/storage.py)
#
#   s3_endpoint   session: moto S3 server on 127.0.0.1, yields its endpoint URL
#   gcs_endpoint  session: fake-gcs-server (memory backend), yields its endpoint URL
#   s3_root       function: fresh bucket -> ("s3://<bucket>/run", storage_options)
#   gcs_root      function: fresh bucket -> ("gs://<bucket>/run", storage_options)
#   store_url     function, parametrized over local/memory/s3/gcs ->
#                 (url, storage_options); open with Store.from_url(*store_url)
#
# A test module can run against a subset with
#   @pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
# The servers start only when a test first asks for them.
# =============================================================================

STORE_BACKENDS = ["local", "memory", "s3", "gcs"]


def s3_storage_options(endpoint: str) -> dict:
    # No region_name in client_kwargs: s3fs's mkdir turns it into a CreateBucket
    # LocationConstraint, and moto (like AWS) rejects "us-east-1" there.
    return {**S3_TEST_CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint}}


def gcs_storage_options(endpoint: str) -> dict:
    return {"token": "anon", "project": "test", "endpoint_url": endpoint}


def _bucket_name() -> str:
    return f"ckd-{uuid.uuid4().hex[:20]}"


def _make_bucket_fs(protocol: str, options: dict):
    import fsspec

    return fsspec.filesystem(protocol, skip_instance_cache=True, use_listings_cache=False, **options)


@pytest.fixture(scope="session")
def s3_endpoint():
    server = start_moto_server()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_endpoint():
    server = start_fake_gcs_server()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
    try:
        yield server.endpoint
    finally:
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
        server.stop()


def _bucket_fixture(protocol: str, options: dict):
    fs = _make_bucket_fs(protocol, options)
    bucket = _bucket_name()
    fs.mkdir(bucket)
    try:
        yield f"{protocol}://{bucket}/run", dict(options)
    finally:
        try:  # free the emulator's memory; a failure here must not fail the test
            fs.rm(bucket, recursive=True)
        except Exception:
            pass


@pytest.fixture
def s3_root(s3_endpoint):
    yield from _bucket_fixture("s3", s3_storage_options(s3_endpoint))


@pytest.fixture
def gcs_root(gcs_endpoint):
    yield from _bucket_fixture("gs", gcs_storage_options(gcs_endpoint))


@pytest.fixture(params=STORE_BACKENDS)
def store_url(request, tmp_path):
    """(url, storage_options) of an empty run root on each backend in turn."""
    backend = request.param
    if backend == "local":
        yield str(tmp_path / "run"), {}
    elif backend == "memory":
        import fsspec

        root = f"/ckd-{uuid.uuid4().hex}"
        yield f"memory://{root}", {}
        try:
            fsspec.filesystem("memory").rm(root, recursive=True)
        except FileNotFoundError:
            pass
    elif backend == "s3":
        yield request.getfixturevalue("s3_root")
    elif backend == "gcs":
        yield request.getfixturevalue("gcs_root")
    else:
        raise ValueError(f"unknown store backend {backend!r}")

# ============================ end of storage section ==========================


# =============================================================================
# Spans (loader/spans.py)
#
#   every test: each request a replica of this process answered reports, in engine_data.policy_versions,
#   every version the replica served while it ran (tests/spans_check.py); the test fails otherwise
# =============================================================================

@pytest.fixture(scope="session", autouse=True)
def _span_check_installed():
    from tests import spans_check

    with pytest.MonkeyPatch.context() as mp:
        spans_check.install(mp)
        yield spans_check


@pytest.fixture(autouse=True)
def spans_hold_every_version_served(_span_check_installed):
    seen = len(_span_check_installed.violations)
    yield
    found = _span_check_installed.violations[seen:]
    if found:
        pytest.fail("spans short of the versions served:\n" + "\n".join(found), pytrace=False)

# ============================ end of spans section ============================


# =============================================================================
# Workers (make test: two pytest-xdist workers, --dist loadfile)
#
#   a module's tests run on one worker, so its module fixtures are made once; every test that starts a vLLM
#   server lives in tests/loader/engines/vllm/, and that whole folder is one unit of work, run first: two vLLM
#   servers at once on a two-core machine would starve each other. So a test of make test that starts vLLM
#   (a VllmServer, build_engine("vllm"), `ckptdelta serve --engine vllm`) goes in that folder.
# =============================================================================

VLLM_TESTS = "tests/loader/engines/vllm/"


def _scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "vllm" if module.startswith(VLLM_TESTS) else module


@pytest.hookimpl(optionalhook=True)     # pytest-xdist's hook: absent without the plugin (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """loadfile, with tests/loader/engines/vllm/ as one file (the nodeids' own text is all the controller has:
    pytest 9's nodeids no longer take xdist_group's suffix)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return VllmOnOneWorker(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The vLLM tests first (the longest unit of work starts at once; the other worker takes the rest)."""
    items.sort(key=lambda item: _scope(item.nodeid) != "vllm")   # stable: each module's order is kept

# ============================ end of workers section ==========================
