"""``ckptdelta publish | ls | gc``: the trainer side from a shell.

``publish`` takes a safetensors file or a Hugging Face model directory and
publishes it as the run's next snapshot (the run's chain is rebuilt from the
bucket to encode the delta, exactly as a restarted trainer does). ``ls`` lists
the committed snapshots, ``gc`` applies retention.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from ckptdelta.delta.errors import CkptDeltaError, PublishInputError, SnapshotNotFoundError
from ckptdelta.delta.manifest import RUN_KEY
from ckptdelta.delta.storage import Store

from ckptdelta.cli.console import guarded, plural
from ckptdelta.cli.options import UsageError, add_storage_args, count, number, storage_options

from ckptdelta.publisher import lora
from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher.gc import collect
from ckptdelta.publisher.publisher import Publisher
from ckptdelta.publisher.runs import committed_versions, read_manifest, read_run_info

log = logging.getLogger("ckptdelta.publisher")


def add_commands(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "publish", help="publish a safetensors file, HF model directory or PEFT adapter as a run's next snapshot",
        description="Publish SRC (a .safetensors file, or a Hugging Face model directory of safetensors shards) "
                    "as the next snapshot of the run at URL. The directory's other files (config.json, tokenizer "
                    "files, generation_config.json) travel with anchors. A PEFT adapter directory "
                    "(adapter_config.json + adapter_model.safetensors) makes a LoRA run: its anchors are adapter "
                    "directories, and the run records its base model (--base-model).")
    p.add_argument("src", metavar="SRC",
                   help="a .safetensors file, a Hugging Face model directory, or a PEFT adapter directory")
    p.add_argument("url", metavar="URL", help="the run: a local path, file://, s3://bucket/prefix, gs://bucket/prefix "
                                               "... (created by its first publish)")
    p.add_argument("--step", type=count(0), required=True, help="the trainer step of these weights")
    p.add_argument("--anchor", action="store_true", help="write a full anchor whatever the policy says")
    p.add_argument("--metadata", action="append", default=[], metavar="K=V", help="string metadata (repeatable)")
    p.add_argument("--anchor-every", type=count(1), default=20, metavar="N",
                   help="anchor every N versions (default: 20)")
    p.add_argument("--shard-bytes", type=count(1), default=5 * 2**30, metavar="B",
                   help="anchor shard size (default: 5 GiB)")
    p.add_argument("--codec", choices=("context", "fast"), default="context",
                   help="how a delta is coded: context (smallest) or fast (quicker to encode and decode, larger "
                        "deltas); Publisher(codec='auto') picks per delta from timings a one-shot command does "
                        "not have (default: context)")
    p.add_argument("--base-model", metavar="DIR", default=None,
                   help="a PEFT adapter's base model directory, hashed into the run's record (default: the base "
                        "the run records already, else adapter_config.json's base_model_name_or_path when it is a "
                        "local directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_storage_args(p)
    p.set_defaults(func=guarded(cmd_publish, "publish"))

    p = subparsers.add_parser("ls", help="list a run's committed snapshots",
                              description="One row per committed snapshot of the run at URL: the bytes its "
                                          "weights take in the bucket, its extra files (an anchor's config and "
                                          "tokenizer) apart, and the weights' ratio to their full size.")
    p.add_argument("url", metavar="URL", help="the run: a local path, file://, s3://bucket/prefix ...")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    add_storage_args(p)
    p.set_defaults(func=guarded(cmd_ls, "ls"))

    p = subparsers.add_parser(
        "gc", help="delete old snapshots and debris of failed publishes",
        description="Keep the last K anchors and every snapshot after the oldest of them; delete older manifests, "
                    "their data, and unreferenced objects older than the grace period.")
    p.add_argument("url", metavar="URL", help="the run: a local path, file://, s3://bucket/prefix ...")
    p.add_argument("--keep-anchors", type=count(1), default=2, metavar="K",
                   help="keep the newest K anchors and every snapshot after the oldest of them (default: 2)")
    p.add_argument("--grace-seconds", type=number(0), default=3600, metavar="S",
                   help="keep unreferenced objects younger than this, since a publish may be in flight "
                        "(default: 3600)")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_storage_args(p)
    p.set_defaults(func=guarded(cmd_gc, "gc"))


def _split_kv(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"{flag} takes K=V, got {item!r}")
    return key, value


# --- publish -----------------------------------------------------------------------------

def load_source(src: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors, extra files name -> path) of a .safetensors file or a model directory."""
    from safetensors.torch import load_file

    if os.path.isfile(src):
        if not src.endswith(".safetensors"):
            raise PublishInputError(f"{src}: not a .safetensors file or a model directory")
        return load_file(src), {}
    if not os.path.isdir(src):
        raise PublishInputError(f"{src}: no such file or directory")
    index = os.path.join(src, anchor_fmt.INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise PublishInputError(f"{src}: no .safetensors files")
    tensors: dict[str, Any] = {}
    for name in files:
        for k, v in load_file(os.path.join(src, name)).items():
            if k in tensors:
                raise PublishInputError(f"{src}: tensor {k!r} appears in more than one shard")
            tensors[k] = v
    return tensors, anchor_fmt.model_dir_files(src)


def load_adapter_source(src: str, url: str, base_model: str | None,
                        options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, str], Any]:
    """(tensors, extra files, AdapterSpec) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    weights = os.path.join(src, lora.ADAPTER_WEIGHTS_NAME)
    if not os.path.isfile(weights):
        other = " (only adapter_model.bin: save it with safe_serialization=True)" \
            if os.path.isfile(os.path.join(src, "adapter_model.bin")) else ""
        raise PublishInputError(f"{src}: holds {lora.ADAPTER_CONFIG_NAME} but no "
                                f"{lora.ADAPTER_WEIGHTS_NAME}{other}: not a PEFT adapter directory")
    config = lora.read_config(src)
    if base_model is not None:
        base = lora.BaseModel.of(base_model, name=config.get("base_model_name_or_path") or None)
    else:
        base = _recorded_base(url, options, config) or _configured_base(src, config)
    extra = {k: v for k, v in anchor_fmt.model_dir_files(src).items() if k != lora.ADAPTER_CONFIG_NAME}
    return load_file(weights), extra, lora.AdapterSpec(config, base)


def _recorded_base(url: str, options: dict[str, Any] | None, config: dict[str, Any]) -> Any:
    """The base the run's newest snapshot records, when the adapter names the same one."""
    with Store.from_url(url, options) as store:
        versions = committed_versions(store)
        if not versions:
            return None
        rec = read_manifest(store, versions[-1], None).adapter
    named = config.get("base_model_name_or_path")
    if rec is None or (named and named != rec.base_model):
        return None
    log.info("%s: the adapter's base is the one the run records, %s", url, rec.describe_base())
    return lora.BaseModel(rec.base_model, rec.base_xxh3)


def _configured_base(src: str, config: dict[str, Any]) -> Any:
    named = config.get("base_model_name_or_path")
    if named and os.path.isfile(os.path.join(named, "config.json")):
        return lora.BaseModel.of(named)
    raise PublishInputError(f"{src}: a LoRA run records its base model's weights, and the adapter names "
                            f"{named!r}, which is not a model directory here: give --base-model DIR")


def cmd_publish(args: argparse.Namespace) -> int:
    metadata = dict(_split_kv(m, "--metadata") for m in args.metadata)
    spec = None
    if os.path.isfile(os.path.join(args.src, lora.ADAPTER_CONFIG_NAME)):
        tensors, extra, spec = load_adapter_source(args.src, args.url, args.base_model, storage_options(args))
    elif args.base_model is not None:
        raise PublishInputError(f"--base-model is for PEFT adapter directories; {args.src} holds no "
                                f"{lora.ADAPTER_CONFIG_NAME}")
    else:
        tensors, extra = load_source(args.src)
    with Publisher(args.url, storage_options=storage_options(args), extra_files=extra,
                   anchor_every=args.anchor_every, shard_bytes=args.shard_bytes, codec=args.codec,
                   adapter=spec) as pub:
        r = pub.publish(tensors, args.step, metadata=metadata, anchor=args.anchor)
    if args.json:
        print(json.dumps({"run_id": pub.run_id, **_result_dict(r)}))
    else:
        extra = f" + {_human(r.extra_bytes)} extra files" if r.extra_bytes else ""
        print(f"{r.name} ({r.kind}, step {r.step}): weights {_human(r.stored_bytes - r.extra_bytes)} stored of "
              f"{_human(r.full_bytes)} ({100 * r.ratio:.2f}%){extra}, {r.n_changed_tensors}/{r.n_tensors} tensors "
              f"changed, {r.total_s:.2f}s ({r.reason}{'; codec ' + r.codec if r.kind == 'delta' else ''})")
    return 0


def _result_dict(r: Any) -> dict[str, Any]:
    return asdict(r)


# --- ls ----------------------------------------------------------------------------------

def list_snapshots(url: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One dict per committed snapshot, oldest first; an unreadable manifest gets a row with ``error``."""
    with Store.from_url(url, storage_options) as store:
        info = read_run_info(store)
        run_id = info.run_id if info else None
        versions = committed_versions(store)
        if info is None and not versions:  # a typo, a bucket's parent, a run's own subfolder
            raise SnapshotNotFoundError(f"no run at {url}: {RUN_KEY} does not exist and no snapshot is committed "
                                        "there (give the run's own URL, the folder that holds RUN.json)")

        def row(v: int) -> dict[str, Any]:
            try:
                m = read_manifest(store, v, run_id)
            except CkptDeltaError as e:
                return {"version": v, "name": f"v{v:08d}", "error": str(e)}
            weights = min(m.stored_bytes, sum(o.size for o in m.objects))   # shards (+ index) or delta objects
            return {"version": m.version, "name": m.name, "kind": m.kind, "parent": m.parent_version,
                    "anchor": m.anchor_version, "step": m.step, "stored_bytes": m.stored_bytes,
                    "weights_bytes": weights, "extra_bytes": m.stored_bytes - weights,
                    "full_bytes": m.full_bytes, "ratio": weights / max(1, m.full_bytes),
                    "tensors": len(m.tensors), "created": m.created}

        with ThreadPoolExecutor(min(16, max(1, len(versions)))) as pool:
            return list(pool.map(row, versions))


def cmd_ls(args: argparse.Namespace) -> int:
    rows = list_snapshots(args.url, storage_options(args))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'version':>8} {'name':<10} {'kind':<7} {'parent':>7} {'step':>8} {'weights':>11} {'full':>11} "
          f"{'ratio':>8} {'extra files':>11}  created")
    for r in rows:
        if "error" in r:
            print(f"{r['version']:>8} {r['name']:<10} unreadable: {r['error']}")
            continue
        parent = "-" if r["parent"] is None else r["parent"]
        step = "-" if r["step"] is None else r["step"]
        extra = _human(r["extra_bytes"]) if r["extra_bytes"] else "-"
        print(f"{r['version']:>8} {r['name']:<10} {r['kind']:<7} {parent:>7} {step:>8} "
              f"{_human(r['weights_bytes']):>11} {_human(r['full_bytes']):>11} {100 * r['ratio']:>7.2f}% "
              f"{extra:>11}  {r['created']}")
    return 0


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


# --- gc ----------------------------------------------------------------------------------

def cmd_gc(args: argparse.Namespace) -> int:
    report = collect(args.url, keep_anchors=args.keep_anchors, storage_options=storage_options(args),
                     grace_seconds=args.grace_seconds, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    verb = "would delete" if report.dry_run else "deleted"
    print(f"kept {plural(len(report.kept_versions), 'snapshot')}; {verb} "
          f"{plural(len(report.deleted_versions), 'manifest')} and {plural(len(report.deleted_objects), 'object')} "
          f"({_human(report.deleted_bytes)}); {plural(len(report.young_orphans), 'unreferenced object')} younger "
          "than the grace period kept")
    return 0
