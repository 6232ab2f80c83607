"""Write valid ckptdelta runs straight from the format modules, for loader tests.

The loader must be testable without publisher/: this helper lays out a run the
way docs/FORMAT.md says a publisher does (RUN.json, anchors as HF-style sharded
safetensors with extra files, deltas as delta objects, one manifest per version,
a head pointer), using only ckptdelta.delta.encode, ckptdelta.delta.container, ckptdelta.delta.manifest and
safetensors. Each run comes with its ground truth (every version's tensors) so
tests compare reconstructions bit for bit.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass, field

import safetensors.torch
import torch
import xxhash

from ckptdelta.delta import digest_hex, encode
from ckptdelta.delta.container import ObjectWriter
from ckptdelta.delta.manifest import (HEAD_KEY, RUN_KEY, Head, Manifest, ObjectRef, RunInfo, TensorEntry, anchor_prefix,
                                      delta_prefix, manifest_key, now_iso)
from ckptdelta.delta.storage import Store

CONFIG_JSON = json.dumps({"model_type": "toy", "hidden_size": 32}).encode()


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def reference_weights(seed: int = 0, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """Small reference-like weights: bf16 matrices of ~0.02, fp32 norms, an int buffer, specials."""
    g = torch.Generator().manual_seed(seed)
    d, v = 32 * scale, 96 * scale
    w = {
        "model.embed_tokens.weight": (torch.randn(v, d, generator=g) * 0.02).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(d, d, generator=g) * 0.02).bfloat16(),
        "model.layers.0.self_attn.o_proj.weight": (torch.randn(d, d, generator=g) * 0.02).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(2 * d, d, generator=g) * 0.02).bfloat16(),
        "model.layers.0.input_layernorm.weight": 1 + torch.randn(d, generator=g) * 0.05,
        "model.layers.0.frozen.bias": (torch.randn(d, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": 1 + torch.randn(d, generator=g) * 0.05,
        "lm_head.weight": (torch.randn(v, d, generator=g) * 0.02).bfloat16(),
        "model.step_counter": torch.tensor([7], dtype=torch.int64),
    }
    # bit patterns a float comparison would get wrong: NaN payloads, -0.0, inf, subnormals
    q = w["model.layers.0.self_attn.q_proj.weight"].view(-1).view(torch.int16)
    q[:5] = torch.tensor([0x7FC1, -0x8000, 0x7F80, 0x0001, -0x0040], dtype=torch.int16)  # NaN, -0, inf, subnormal, NaN
    n = w["model.norm.weight"].view(torch.int32)
    n[:3] = torch.tensor([0x7FC00123, -0x80000000, 0x00000001], dtype=torch.int32)
    return w


def perturb(prev: dict[str, torch.Tensor], seed: int, *, fraction: float = 0.02,
            keep: tuple[str, ...] = ("model.layers.0.frozen.bias",)) -> dict[str, torch.Tensor]:
    """The next policy: a few elements of each tensor move by a few ulps (bits-level), specials included.

    Tensors named in ``keep`` stay bit-identical, so manifests carry unchanged entries."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in prev.items():
        t = t.clone()
        if name in keep:
            out[name] = t
            continue
        flat = t.view(-1)
        if t.dtype in (torch.bfloat16, torch.float16):
            ints = flat.view(torch.int16)
        elif t.dtype == torch.float32:
            ints = flat.view(torch.int32)
        else:
            ints = flat
        mask = torch.rand(flat.shape, generator=g) < fraction
        mask[int(torch.randint(0, flat.numel(), (1,), generator=g))] = True
        step = torch.randint(-3, 4, flat.shape, generator=g).to(ints.dtype)
        ints[mask] += step[mask]
        if t.dtype == torch.bfloat16 and flat.numel() > 16:
            ints[8] = [0x7FC0 + seed % 7, -0x8000, 0x0000][seed % 3]   # NaN payload / -0.0 / +0.0
        if t.dtype == torch.float32 and flat.numel() > 16:
            ints[8] = [0x7FC00000 + seed, -0x80000000][seed % 2]
        out[name] = t
    return out


def trajectory(n_versions: int, seed: int = 0, **kw) -> list[dict[str, torch.Tensor]]:
    out = [reference_weights(seed, **kw)]
    for v in range(1, n_versions):
        out.append(perturb(out[-1], seed * 1000 + v))
    return out


def _safetensors_entries(blob: bytes) -> dict[str, tuple[int, int]]:
    """Absolute [offset, length) of each tensor's data inside a safetensors file."""
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8: 8 + n])
    return {name: (8 + n + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items() if name != "__metadata__"}


def _xxh(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def _tensor_xxh(t: torch.Tensor) -> str:
    from ckptdelta.delta import digest
    return digest_hex(digest(t))


@dataclass
class Run:
    url: str
    storage_options: dict
    run_id: str
    writer_id: str
    truth: dict[int, dict[str, torch.Tensor]]
    anchors: list[int]
    store: Store
    manifests: dict[int, Manifest] = field(default_factory=dict)

    @property
    def latest(self) -> int:
        return max(self.truth)


def write_run(url: str, storage_options: dict | None = None, *, versions: list[dict[str, torch.Tensor]],
              anchors: set[int] | None = None, run_id: str = "run-test", writer_id: str = "w0",
              extra_files: dict[str, bytes] | None = None, n_shards: int = 2, objects_per_delta: int = 2,
              chunk_elems: int = 256, head_lag: int = 0, add_index_file: bool = True) -> Run:
    """Publish ``versions`` (version i = versions[i]) as one run; versions in ``anchors`` are stored whole.

    ``head_lag`` leaves the head pointer that many versions behind, as after a crash
    between a manifest and the head."""
    anchors = {0} if anchors is None else set(anchors) | {0}
    extra_files = {"config.json": CONFIG_JSON, "tokenizer.json": b'{"version": "1.0"}'} if extra_files is None \
        else extra_files
    store = Store.from_url(url, storage_options)
    store.put_if_absent(RUN_KEY, RunInfo(run_id, now_iso()).to_json())
    run = Run(url, dict(storage_options or {}), run_id, writer_id, {}, sorted(anchors), store)
    last_anchor = 0
    for v, tensors in enumerate(versions):
        tensors = {k: t.contiguous() for k, t in tensors.items()}
        if v in anchors:
            m = _write_anchor(store, run_id, writer_id, v, tensors, extra_files, n_shards, add_index_file)
            last_anchor = v
        else:
            m = _write_delta(store, run_id, writer_id, v, last_anchor, versions[v - 1], tensors,
                             objects_per_delta, chunk_elems, run.manifests[v - 1])
        data = m.to_json()
        store.put_if_absent(manifest_key(v), data)
        if v < len(versions) - head_lag:
            store.put(HEAD_KEY, Head(run_id, v, _xxh(data)).to_json())
        run.truth[v] = {k: t.clone() for k, t in tensors.items()}
        run.manifests[v] = m
    return run


def _write_anchor(store, run_id, writer_id, v, tensors, extra_files, n_shards, add_index_file) -> Manifest:
    prefix = anchor_prefix(v, writer_id)
    names = sorted(tensors)
    shards = [names[i::n_shards] for i in range(n_shards) if names[i::n_shards]]
    objects, entries, weight_map = [], {}, {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        blob = safetensors.torch.save({k: tensors[k] for k in shard}, metadata={"format": "pt"})
        key = f"{prefix}/{fname}"
        store.put(key, blob)
        objects.append(ObjectRef(key, len(blob), _xxh(blob)))
        for name, (off, length) in _safetensors_entries(blob).items():
            t = tensors[name]
            entries[name] = TensorEntry(_dtype_name(t), tuple(t.shape), _tensor_xxh(t), i, off, length)
            weight_map[name] = fname
    files = dict(extra_files)
    if add_index_file:
        files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    extras = []
    for fname, data in sorted(files.items()):
        key = f"{prefix}/{fname}"
        store.put(key, data)
        extras.append(ObjectRef(key, len(data), _xxh(data)))
    return Manifest(run_id=run_id, version=v, kind="anchor", parent_version=v - 1 if v else None, anchor_version=v,
                    created=now_iso(), step=v, writer_id=writer_id, objects=tuple(objects), tensors=entries,
                    extra_files=tuple(extras), metadata={"source": "bucketgen"},
                    full_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                    stored_bytes=sum(o.size for o in objects))


def _write_delta(store, run_id, writer_id, v, anchor, old, new, objects_per_delta, chunk_elems,
                 parent: Manifest) -> Manifest:
    prefix = delta_prefix(v, writer_id)
    changed = [k for k in sorted(new) if k not in old or not bits_equal(old[k], new[k])]
    groups = [changed[i::objects_per_delta] for i in range(objects_per_delta) if changed[i::objects_per_delta]]
    objects, entries = [], {}
    for i, group in enumerate(groups):
        buf = io.BytesIO()
        w = ObjectWriter(buf)
        for name in group:
            o = old.get(name)
            same_kind = o is not None and o.dtype == new[name].dtype and o.shape == new[name].shape
            enc = encode(o if same_kind else None, new[name], name=name, chunk_elems=chunk_elems)
            off, length = w.add(name, enc.to_bytes())
            entries[name] = TensorEntry(_dtype_name(new[name]), tuple(new[name].shape), _tensor_xxh(new[name]),
                                        i, off, length)
        w.finish()
        data = buf.getvalue()
        key = f"{prefix}/delta-{i:05d}.ckd"
        store.put(key, data)
        objects.append(ObjectRef(key, len(data), _xxh(data)))
    for name in new:
        if name not in entries:
            pe = parent.tensors[name]
            entries[name] = TensorEntry(pe.dtype, pe.shape, pe.xxh3, None)
    return Manifest(run_id=run_id, version=v, kind="delta", parent_version=v - 1, anchor_version=anchor,
                    created=now_iso(), step=v, writer_id=writer_id, objects=tuple(objects),
                    tensors=dict(sorted(entries.items())),
                    full_bytes=sum(t.numel() * t.element_size() for t in new.values()),
                    stored_bytes=sum(o.size for o in objects))


def _dtype_name(t: torch.Tensor) -> str:
    from ckptdelta.delta import dtypes
    return dtypes.of(t).name


def make_run(url: str, storage_options: dict | None = None, *, n_versions: int = 4, seed: int = 0,
             anchors: set[int] | None = None, **kw) -> Run:
    """A run of ``n_versions`` reference-like versions (anchor at 0 unless told otherwise)."""
    return write_run(url, storage_options, versions=trajectory(n_versions, seed), anchors=anchors, **kw)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equality of bits (NaN payloads, -0.0), with dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # flat first: a 0-d tensor cannot be viewed as bytes of another width
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == \
        bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy())
