"""``ckptdelta serve``: run a replica (``hotload`` and ``status``, for one replica or many: ckptdelta/cli/fleet.py)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from ckptdelta.cli.console import guarded, usage_error
from ckptdelta.loader import stopping
from ckptdelta.cli.options import UsageError, add_storage_args, count, number, storage_options
from ckptdelta.delta.errors import CkptDeltaError, NotServableError

if TYPE_CHECKING:
    from ckptdelta.loader.starting import StartingServer

log = logging.getLogger("ckptdelta.server")


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="run a sampling replica that hot-loads snapshots of a run",
        description="Serve a causal LM over an OpenAI-compatible API (docs/SERVING.md) and hot-load new "
                    "snapshots of a run from its bucket while serving.")
    p.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                   help="what samples: the built-in reference decode loop, or vLLM's own OpenAI server "
                        "(options after a bare '--' go to vLLM); docs/SERVING.md")
    p.add_argument("--bucket", help="the run's URL (local dir, s3://, gs://, any fsspec URL)")
    p.add_argument("--snapshot", default=None,
                   help="with --bucket: the snapshot to start from, 'latest', a version or a name like v00000042 "
                        "(default: latest); not with --model, which starts from DIR")
    p.add_argument("--model", metavar="DIR", help="start from this HF model directory instead (version unknown)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=count(0, 65535), default=8000,
                   help="port to listen on (default: 8000; 0 picks a free one, named in the log)")
    p.add_argument("--replica-id", default=None, help="name in engine_data and /v1/status (default: host:port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $CKPTDELTA_API_KEY)")
    add_storage_args(p)
    p.add_argument("--cache-dir", default=None, help="local cache for fetched objects and materialized snapshots")
    p.add_argument("--cache-max-gb", type=number(0), default=None, metavar="GB",
                   help="bound of --cache-dir's cached objects, least recently used evicted first (default: a "
                        "quarter of its disk, at most 32; 0: no bound; also $CKPTDELTA_CACHE_MAX_GB)")
    p.add_argument("--drain-timeout", type=number(0), default=None, metavar="S",
                   help="on SIGTERM, SIGINT (Ctrl-C) or SIGHUP: stop accepting requests, let those in flight "
                        "finish for up to S seconds, let a hot-load in its pause end it, then stop the engine, "
                        "clean up and exit 0 (default 25)")
    p.add_argument("--device", default="cpu",
                   help="torch device for the model of the reference engine (cpu, cuda, cuda:1...; default: cpu)")
    p.add_argument("--cache-policy", choices=["recompute", "keep"], default="recompute",
                   help="what in-flight requests do with their KV cache after a swap (default: recompute; "
                        "docs/SERVING.md)")
    p.add_argument("--model-name", default=None, help="the 'model' field of responses")
    p.add_argument("--base-model", metavar="DIR", default=None,
                   help="a LoRA run's base model directory (default: the one the run records, when it is a "
                        "local directory); its weights must be the ones the adapter was trained on")
    v = p.add_argument_group("vLLM engine (--engine vllm)")
    v.add_argument("--attach", metavar="URL", default=None,
                   help="use a vLLM server already running at URL (http://HOST:PORT, or unix:PATH for one "
                        "started with --uds PATH; started with --worker-extension-cls "
                        "ckptdelta.loader.engines.vllm.worker.extension.CkptDeltaWorker and VLLM_SERVER_DEV_MODE=1 on the snapshot's "
                        "weights) instead of starting one")
    v.add_argument("--verify", choices=["sampled", "full", "off"], default="sampled",
                   help="prove the live weights after every swap: sampled (default: in the pause, plain tensors "
                        "whole and 16 random input columns of each re-packed matrix; after resuming, all of them), "
                        "full (all of them inside the pause), off")
    v.add_argument("--apply", choices=["auto", "reload"], default="auto", dest="apply_mode",
                   help="auto: write only the changed elements where vLLM's kernels read the parameter as is "
                        "(norms and embeddings; on CUDA also unquantized linears), build and re-pack the other "
                        "changed modules beside the live ones while serving and swap them in during the pause "
                        "(more host memory while a hot-load prepares: docs/SERVING.md); reload: reload every "
                        "changed tensor's module inside the pause")
    v.add_argument("--lora-slots", type=count(2), default=3, metavar="K",
                   help="a LoRA run: adapter versions vLLM holds at once (default 3, at least 2); each request runs "
                        "to its end on the version it was admitted on, and a hot-load writes into a slot no request "
                        "holds")
    v.add_argument("--vllm-log", default=None, metavar="PATH", help="where the started vLLM server logs")
    v.add_argument("--request-timeout", type=number(0, above=True), default=600.0, metavar="S",
                   help="seconds a sampling request may wait for vLLM's answer before it fails with 504 "
                        "(default 600)")
    v.add_argument("--control-timeout", type=number(0, above=True), default=300.0, metavar="S",
                   help="seconds each control call to vLLM (pause, swap, proof, resume) may take before the "
                        "hot-load fails (default 300)")
    v.add_argument("--on-engine-failure", choices=["exit", "stay"], default="exit",
                   help="when vLLM dies or stops answering: exit with status 3 so that a supervisor starts a "
                        "new replica (default), or stay up answering /health 503")
    p.set_defaults(func=guarded(cmd_serve, "serve"))

    from ckptdelta.cli import fleet as fleet_cli

    fleet_cli.add_commands(subparsers)    # hotload and status, for one replica or many


def cmd_serve(args: argparse.Namespace) -> int:
    passthrough = list(getattr(args, "passthrough", []) or [])
    usage = None
    if passthrough and args.engine != "vllm":
        usage = "options after '--' are for --engine vllm only"
    elif args.engine == "vllm" and (args.model or not args.bucket):
        usage = "--engine vllm serves a run's snapshots: give --bucket URL (and not --model)"
    elif not args.bucket and not args.model:
        usage = "give --bucket URL (a run to serve and hot-load), --model DIR (fixed weights), or both"
    elif args.snapshot is not None and not args.bucket:
        usage = (f"--snapshot {args.snapshot} names a snapshot of a run: give --bucket URL too (--model DIR "
                 "serves the weights in DIR)")
    elif args.snapshot is not None and args.model:
        usage = (f"--snapshot {args.snapshot} with --model: the replica starts from DIR, and its first hot-load "
                 "goes through an anchor; drop --model to start from the snapshot, or --snapshot to start from DIR")
    if usage:
        return usage_error("serve", usage)
    with stopping.signals_stop():     # SIGTERM, SIGINT, SIGHUP: a graceful stop (loader/stopping.py)
        try:
            snapshot, sock = _check_before_loading(args)
            # from here until the app serves, the port answers STARTING (loader/starting.py), not refusals
            starting = _starting_server(args, sock, snapshot)
            try:
                return _serve(args, sock, snapshot, passthrough, starting)
            finally:
                starting.stop()
                sock.close()
        except stopping.TerminationRequested:
            log.warning("replica stopped (%s)", stopping.reason())
            return 0


def _replica_id(args: argparse.Namespace) -> str:
    return args.replica_id or f"{socket.gethostname()}:{args.port}"


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("CKPTDELTA_API_KEY") or None


def _starting_server(args: argparse.Namespace, sock: socket.socket, snapshot: "str | int") -> "StartingServer":
    """The port listens from now on: STARTING until the engine serves (the run and version said once known)."""
    from ckptdelta.loader.starting import StartingServer

    server = StartingServer(sock, replica_id=_replica_id(args), engine=args.engine, api_key=_api_key(args),
                            run_id=getattr(args, "run_id", None),
                            version=snapshot if isinstance(snapshot, int) else None)
    return server.start()


def _serve(args: argparse.Namespace, sock: socket.socket, snapshot: "str | int", passthrough: list[str],
           starting: "StartingServer") -> int:
    import uvicorn

    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.heap import freeze_started_heap
    from ckptdelta.loader.server import create_app

    stopper = _StopOnEngineFailure(getattr(args, "on_engine_failure", "exit") == "exit")
    _sweep_host(args)
    engine = build_engine(args.engine, bucket=args.bucket, snapshot=snapshot, model_dir=args.model,
                          storage_options=storage_options(args), cache_dir=args.cache_dir, device=args.device,
                          cache_policy=args.cache_policy, model_name=args.model_name, attach=args.attach,
                          base_model=args.base_model, lora_slots=args.lora_slots,
                          verify=args.verify, apply_mode=args.apply_mode, vllm_args=passthrough,
                          vllm_log=args.vllm_log, request_timeout=args.request_timeout,
                          control_timeout=args.control_timeout, on_failure=stopper)
    replica_id = _replica_id(args)
    api_key = _api_key(args)
    hotloads = None
    try:
        app = create_app(engine, replica_id=replica_id, api_key=api_key)
        hotloads = app.state.hotloads
        freeze_started_heap()   # what start-up left alive is not walked by every full collection (loader/heap.py)
        starting.stop()     # the socket, still listening, is the app's: what connects from now on waits for it

        def on_stop() -> None:     # at the signal, before the drain: a hot-load still preparing is dropped
            if hotloads is not None:
                hotloads.request_stop(_stopping_why(replica_id))

        log.info("replica %s (%s engine) serving policy version %s on http://%s:%d%s", replica_id, engine.kind,
                 engine.version, args.host, args.port, " (API key required)" if api_key else "")
        drain = stopping.DRAIN_TIMEOUT_S if args.drain_timeout is None else args.drain_timeout
        stopper.server = stopping.uvicorn_server(
            uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain), on_stop=on_stop)
        if stopper.why is None or not stopper.enabled:
            stopper.server.run(sockets=[sock])
    finally:
        stopping.shield()      # clean-up is not cut short by another signal
        try:
            if hotloads is not None:
                # a hot-load past its prepare ends its pause (the engine generates again, a user's vLLM too)
                # before the engine closes; closed under it, the pause would outlive the replica. A dead engine
                # fails its control calls at once, but one that stopped answering times each of them out
                failed = stopper.why is not None and not stopping.requested()
                hotloads.stop(_stopping_why(replica_id, stopper.why), ENGINE_FAILED_WAIT_S if failed else None)
        finally:
            engine.close()
    if stopper.why is not None and stopper.enabled:
        log.critical("replica %s stops: its engine failed (%s)", replica_id, stopper.why)
        return ENGINE_FAILED_EXIT
    return 0


def _stopping_why(replica_id: str, engine_failure: str | None = None) -> str:
    """What a hot-load refused or dropped because the replica stops says, naming it and why."""
    if engine_failure is not None and not stopping.requested():
        return f"replica {replica_id} is stopping: its engine failed ({engine_failure})"
    return f"replica {replica_id} is stopping ({stopping.reason()})"


#: ``ckptdelta serve``'s exit status when its engine died or stopped answering (``--on-engine-failure exit``).
ENGINE_FAILED_EXIT = 3
#: Seconds a replica whose engine failed waits for a running hot-load to end before it closes the engine.
ENGINE_FAILED_WAIT_S = 10.0


class _StopOnEngineFailure:
    """The engine's ``on_failure``: stops the HTTP server, so that ``serve`` exits non-zero and a supervisor
    starts a new replica instead of routing requests to one that can only fail them."""

    def __init__(self, enabled: bool):
        self.enabled, self.why, self.server = enabled, None, None

    def __call__(self, why: str) -> None:
        self.why = why
        if self.enabled and self.server is not None:
            self.server.should_exit = True


def _sweep_host(args: argparse.Namespace) -> None:
    """What dead replicas of this host left (delta/scratch.py), and the disk cache down to its bound."""
    from ckptdelta.loader.cache import MAX_GB_ENV, DiskCache
    from ckptdelta.delta.scratch import sweep_host

    if args.cache_max_gb is not None:
        os.environ[MAX_GB_ENV] = str(args.cache_max_gb)   # every DiskCache of this process (its readers')
    sweep_host(args.cache_dir)
    if args.cache_dir and os.path.isdir(args.cache_dir):
        DiskCache(args.cache_dir).prune()


def _reserve_port(host: str, port: int) -> socket.socket:
    """Bind the replica's address before the engine starts, and keep it bound. Starting takes minutes (vLLM),
    and a port only checked, then let go, is what the engine's own free-port pick or another process may be
    handed meanwhile. Bound but not listening, it refuses connections until the checks are done; from then on
    it answers STARTING (loader/starting.py) until the app serves it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)   # uvicorn's own rule
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse the port
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e} (pick another --port or "
                      "--host)") from None
    return sock


def _check_before_loading(args: argparse.Namespace) -> "tuple[str | int, socket.socket]":
    """What can fail in seconds fails before minutes of download and load (loader/servable.py): the device,
    the port, the model directory or the snapshot's config and tokenizer. Returns the snapshot to serve,
    resolved, so the engine serves the version checked, and the replica's address, bound (``--port 0``: the
    port picked is put in ``args.port``; the run's id, from a bucket, in ``args.run_id``)."""
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.loader.servable import check_device, check_model_dir, check_snapshot

    if args.snapshot is None:       # --snapshot's default: a bucket's latest (None only tells "not given" apart)
        args.snapshot = "latest"

    if args.engine == "reference":
        try:
            check_device(args.device)
        except ValueError as e:
            if isinstance(e, CkptDeltaError):
                raise
            raise UsageError(str(e)) from None
    sock = _reserve_port(args.host, args.port)
    try:
        args.port = sock.getsockname()[1]
        if args.model:
            check_model_dir(args.model)
            return args.snapshot, sock
        reader = SnapshotReader(args.bucket, storage_options=storage_options(args))
        try:
            version = reader.resolve(args.snapshot)
            check_snapshot(reader, version)
            args.run_id = reader.run_id
        finally:
            reader.store.close()
        return version, sock
    except BaseException:
        sock.close()
        raise
