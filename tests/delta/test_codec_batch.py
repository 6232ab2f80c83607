"""encode_many / apply_many: the one-tensor codec calls over many tensors at once.

Whatever the threads and the window, encode_many gives encode()'s bytes in input
order and apply_many gives apply_()'s bits; apply_many is all or nothing across
its batch; leaving an encode_many early leaves no work behind; and codec calls
made from the codec's own pool threads cannot deadlock it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest
import torch

from ckptdelta import delta
from ckptdelta.delta import chunks, codec, dtypes
from ckptdelta.delta.errors import (ChecksumError, DeltaError, ParentMismatchError, ShapeMismatchError,
                                    UnsupportedDtypeError)

# bf16 patterns a codec that is not bit-exact breaks: +-0.0, NaNs with payloads (quiet, signalling,
# negative), +-inf, subnormals, the largest finite
BF16_SPECIALS = np.array([0x0000, 0x8000, 0x7FC1, 0xFFC5, 0x7F81, 0xFF81, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F],
                         dtype=np.uint16)


def bf16_with_specials(shape: tuple[int, ...], seed: int, special_rate: float = 0.05) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    bits = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    bits = bits.view(torch.int16).numpy().view(np.uint16).copy()
    pick = rng.random(n) < special_rate
    bits[pick] = BF16_SPECIALS[rng.integers(0, BF16_SPECIALS.shape[0], int(pick.sum()))]
    return dtypes.from_bits(bits, dtypes.BY_NAME["BF16"], shape)


def perturb(t, fraction: float, seed: int):
    """``t`` with about ``fraction`` of its elements given other bits (near moves and jumps to specials);
    a tensor for a tensor, an array for an array."""
    g = np.random.default_rng(seed)
    dt = dtypes.of(t)
    bits = dtypes.host_bits(t).copy()
    pick = g.random(bits.shape[0]) < fraction
    k = int(pick.sum())
    bits[pick] = bits[pick] ^ g.integers(1, 1 << min(8, 8 * dt.itemsize), k).astype(bits.dtype)
    if dt.name == "BF16" and k:
        jump = pick & (g.random(bits.shape[0]) < 0.1)
        bits[jump] = BF16_SPECIALS[g.integers(0, BF16_SPECIALS.shape[0], int(jump.sum()))]
    if isinstance(t, np.ndarray):
        return bits.view(t.dtype).reshape(t.shape)
    return dtypes.from_bits(bits, dt, tuple(t.shape))


def same_bits(a, b) -> bool:
    return dtypes.of(a) == dtypes.of(b) and tuple(a.shape) == tuple(b.shape) and \
        np.array_equal(dtypes.host_bits(a), dtypes.host_bits(b))


def mixed_items() -> list[tuple]:
    """(name, old, new) of every kind a checkpoint holds, and some it rarely does."""
    g = torch.Generator().manual_seed(7)
    w = bf16_with_specials((96, 50), 1)
    fp8 = torch.randn(777, generator=g).to(torch.float8_e4m3fn)
    return [
        ("bf16.sparse", w, perturb(w, 0.01, 2)),
        ("bf16.dense", w, perturb(w, 0.9, 3)),
        ("bf16.unchanged", w, w.clone()),
        ("bf16.no_parent", None, bf16_with_specials((33, 7), 4)),
        ("empty", torch.zeros(0, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.bfloat16)),
        ("empty.3d", torch.zeros(3, 0, 2), torch.zeros(3, 0, 2)),
        ("zero_d", torch.tensor(1.5), torch.tensor(-0.0)),
        ("zero_d.unchanged", torch.tensor(7, dtype=torch.int64), torch.tensor(7, dtype=torch.int64)),
        ("f32", torch.randn(1000, generator=g), perturb(torch.randn(1000, generator=g), 0.2, 5)),
        ("fp8", fp8, perturb(fp8, 0.03, 8)),
        ("i32.numpy", np.arange(500, dtype=np.int32), np.arange(500, dtype=np.int32) * 3),
        ("bool", torch.rand(300, generator=g) < 0.5, torch.rand(300, generator=g) < 0.5),
        ("transposed", w.t(), perturb(w, 0.05, 6).t()),
        ("u8.single", torch.tensor([3], dtype=torch.uint8), torch.tensor([4], dtype=torch.uint8)),
    ]


# --- encode_many ---------------------------------------------------------------------------

@pytest.mark.parametrize("threads,window", [(1, None), (2, None), (2, 1), (4, 3), (None, None)])
def test_encode_many_gives_encode_bytes_in_input_order(threads, window):
    items = mixed_items()
    ce = 256       # several chunks per tensor
    want = [codec.encode(o, n, name=k, chunk_elems=ce).to_bytes() for k, o, n in items]
    got = [e.to_bytes() for e in delta.encode_many(iter(items), threads=threads, window=window, chunk_elems=ce)]
    assert got == want
    # the default chunk size (one chunk each), and the same records whatever the thread count
    want = [codec.encode(o, n, name=k).to_bytes() for k, o, n in items]
    assert [e.to_bytes() for e in delta.encode_many(items, threads=threads, window=window)] == want


def test_encode_many_passes_level_context_and_a_known_parent_digest_through():
    w = bf16_with_specials((4000,), 11)
    items = [("a", w, perturb(w, 0.05, 12), codec.digest(w)), ("b", w, perturb(w, 0.3, 13))]
    for kw in ({"level": 1, "context": False}, {"level": 9, "context": True}):
        want = [codec.encode(o, n, name=k, chunk_elems=1000, parent_digest=(p[0] if p else None), **kw).to_bytes()
                for k, o, n, *p in items]
        got = [e.to_bytes() for e in delta.encode_many(items, threads=2, chunk_elems=1000, **kw)]
        assert got == want
    # a known parent digest is trusted, as encode() trusts it (the publisher recorded it)
    (rec,) = delta.encode_many([("c", w, w.clone(), 1234)])
    assert rec.header.parent_digest == 1234


def test_threads_1_runs_every_task_in_the_calling_thread(monkeypatch):
    seen = set()
    real = chunks.encode_chunk

    def recording(*a, **k):
        seen.add(threading.get_ident())
        return real(*a, **k)

    monkeypatch.setattr(chunks, "encode_chunk", recording)
    list(delta.encode_many(mixed_items(), threads=1, chunk_elems=100))
    assert seen == {threading.get_ident()}


def test_items_are_read_no_further_ahead_than_the_window():
    pulled = []
    w = bf16_with_specials((512,), 3)

    def items():
        for i in range(40):
            pulled.append(i)
            yield f"t{i}", w, perturb(w, 0.1, i)

    out = delta.encode_many(items(), threads=2, window=3)
    first = next(out)
    assert first.name == "t0"
    assert len(pulled) <= 3 + 1          # the window of one-chunk tensors, at most one more
    assert [e.name for e in out] == [f"t{i}" for i in range(1, 40)]


@pytest.mark.parametrize("call", ["encode_many", "apply_many"])
def test_an_interrupt_while_a_lane_starts_propagates_instead_of_hanging(monkeypatch, call):
    """A KeyboardInterrupt raised inside the pool's submit (the lane counted, maybe never queued):
    the call must raise it and return, not wait forever in close() for a lane that never runs;
    apply_many leaves every tensor as it was."""
    olds, news, recs = encoded_pairs(98, n=4, chunk_elems=1000)
    lives = [o.clone() for o in olds]

    class Interrupted:
        def submit(self, *a, **k):
            raise KeyboardInterrupt

    monkeypatch.setattr(codec, "_executor", lambda: Interrupted())
    outcome = []

    def run():
        try:
            if call == "encode_many":
                list(delta.encode_many([(f"t{i}", o, n) for i, (o, n) in enumerate(zip(olds, news))], threads=2))
            else:
                delta.apply_many(zip(lives, recs), threads=2)
            outcome.append("returned")
        except KeyboardInterrupt:
            outcome.append("interrupted")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert outcome == ["interrupted"], "the call hung in close()" if not outcome else outcome
    assert all(same_bits(lv, o) for lv, o in zip(lives, olds))


@pytest.mark.parametrize("how", ["close", "drop"])
def test_leaving_encode_many_early_leaves_no_work_running(monkeypatch, how):
    lock = threading.Lock()
    count = {"started": 0, "running": 0}
    real = chunks.encode_chunk

    def counting(*a, **k):
        with lock:
            count["started"] += 1
            count["running"] += 1
        try:
            return real(*a, **k)
        finally:
            with lock:
                count["running"] -= 1

    monkeypatch.setattr(chunks, "encode_chunk", counting)
    w = bf16_with_specials((20_000,), 5)
    items = [(f"t{i}", w, perturb(w, 0.05, i)) for i in range(50)]
    out = delta.encode_many(items, threads=2, window=40, chunk_elems=5000)   # 4 chunks a tensor, 200 in all
    next(out)                            # ten tensors admitted: the first done, the others queued or running
    if how == "close":
        out.close()
    else:
        del out                          # garbage: the generator is closed when the last reference goes
    with lock:
        after = dict(count)
    assert after["running"] == 0         # nothing of the abandoned call is still running...
    assert after["started"] < 200        # ...and what was not started never will be:
    (one,) = delta.encode_many(items[:1], threads=2, chunk_elems=5000)
    with lock:
        assert count["started"] == after["started"] + 4   # the pool ran only this new call's 4 chunks


@pytest.mark.parametrize("threads", [1, 2])
def test_an_encode_error_names_the_tensor_after_the_records_before_it(threads):
    w = bf16_with_specials((3000,), 9)
    items = [("ok.0", w, perturb(w, 0.1, 1)), ("ok.1", None, w),
             ("layers.2.wrong_shape", w, torch.zeros(2999, dtype=torch.bfloat16)), ("never", w, w)]
    out = delta.encode_many(items, threads=threads, chunk_elems=1000)
    assert [next(out).name, next(out).name] == ["ok.0", "ok.1"]
    with pytest.raises(ShapeMismatchError, match="layers.2.wrong_shape"):
        next(out)
    with pytest.raises(StopIteration):
        next(out)
    bad_dtype = [("ok", w, w), ("layers.1.cplx", None, torch.zeros(4, dtype=torch.complex64))]
    with pytest.raises(UnsupportedDtypeError, match="layers.1.cplx"):
        list(delta.encode_many(bad_dtype, threads=threads))


# --- apply_many ------------------------------------------------------------------------------

def encoded_pairs(seed: int, n: int = 5, elems: int = 3000, as_numpy: bool = False,
                  chunk_elems: int = 1000) -> tuple[list, list, list]:
    """Parents, targets and records of ``n`` bf16 tensors (NaN payloads, -0.0): sparse and dense changes.
    ``as_numpy``: the same bits as uint16 arrays (numpy has no bfloat16)."""
    olds = [bf16_with_specials((elems // 50, 50), seed + i) for i in range(n)]
    if as_numpy:
        olds = [dtypes.host_bits(o).reshape(o.shape).copy() for o in olds]
    news = [perturb(o, 0.02 if i % 2 else 0.7, seed + 100 + i) for i, o in enumerate(olds)]
    recs = [codec.encode(o, x, name=f"layers.{i}.w", chunk_elems=chunk_elems)
            for i, (o, x) in enumerate(zip(olds, news))]
    return olds, news, recs


@pytest.mark.parametrize("threads,window", [(1, None), (2, None), (2, 1), (None, 2)])
def test_apply_many_gives_apply_bits_for_every_kind_of_tensor(threads, window):
    items = [(k, o, n) for k, o, n in mixed_items() if o is not None or k == "bf16.no_parent"]
    lives, recs, wants = [], [], []
    for i, (k, o, n) in enumerate(items):
        if o is None:   # a record without parent applies over a live tensor of the same dtype and shape
            o = perturb(n, 0.5, 99)
        rec = codec.encode(o, n, name=k, chunk_elems=256)
        live = o.copy() if isinstance(o, np.ndarray) else o.clone()   # clone() keeps a transposed layout
        lives.append(live)
        recs.append(rec.to_bytes() if i % 2 else rec)                 # bytes and EncodedTensor alike
        wants.append(n)
    delta.apply_many(zip(lives, recs), threads=threads, window=window)
    for (k, _o, _n), live, want in zip(items, lives, wants):
        assert same_bits(live, want), k


@pytest.mark.parametrize("method", ["auto", "torch"])
def test_apply_many_on_strided_and_torch_method_tensors_is_bit_exact(method):
    olds, news, recs = encoded_pairs(20)
    lives = [o.t().contiguous().t() if i % 2 else o.clone() for i, o in enumerate(olds)]   # column-major views
    assert not lives[1].is_contiguous()
    delta.apply_many(zip(lives, recs), threads=2, method=method)
    assert all(same_bits(lv, n) for lv, n in zip(lives, news))


def _corrupt_payload(rec) -> bytes:
    data = bytearray(rec.to_bytes())
    data[rec.header.header_size + 5] ^= 0x40
    return bytes(data)


def _wrong_result_digest(rec):
    return codec.EncodedTensor(dataclasses.replace(rec.header, digest=rec.header.digest ^ 1), rec.payloads)


def _failures(olds, news, recs):
    """Ways the third record of a batch can fail, each with the error it must raise."""
    other = perturb(olds[2], 0.01, 77)
    return {
        "corrupt payload": (lambda: _corrupt_payload(recs[2]), ChecksumError),
        "wrong parent": (lambda: codec.encode(other, news[2], name="layers.2.w"), ParentMismatchError),
        "shape mismatch": (lambda: codec.encode(olds[2][:-1], news[2][:-1], name="layers.2.w"),
                           ShapeMismatchError),
        # only visible once written: the result does not hash to the record's digest
        "result digest": (lambda: _wrong_result_digest(recs[2]), ChecksumError),
    }


@pytest.mark.parametrize("failure", ["corrupt payload", "wrong parent", "shape mismatch", "result digest"])
@pytest.mark.parametrize("threads,window,layout", [(1, None, "contiguous"), (2, None, "contiguous"),
                                                   (2, 1, "contiguous"), (2, None, "strided"),
                                                   (1, None, "numpy")])
@pytest.mark.parametrize("chunk_elems", [1000, 1 << 20])      # three chunks a tensor, or one (one task)
def test_apply_many_is_all_or_nothing_when_the_third_of_five_fails(failure, threads, window, layout, chunk_elems):
    olds, news, recs = encoded_pairs(30, as_numpy=layout == "numpy", chunk_elems=chunk_elems)
    make_bad, error = _failures(olds, news, recs)[failure]
    if layout == "strided":
        lives = [o.t().contiguous().t() for o in olds]     # column-major: staged, then applied
    else:
        lives = [o.copy() if layout == "numpy" else o.clone() for o in olds]
    before = [dtypes.host_bits(lv).copy() for lv in lives]
    batch = list(recs)
    batch[2] = make_bad()
    with pytest.raises(error, match=r"layers\.2\.w"):
        delta.apply_many(zip(lives, batch), threads=threads, window=window)
    for i, (lv, b) in enumerate(zip(lives, before)):
        assert np.array_equal(dtypes.host_bits(lv), b), f"tensor {i} changed"
    # the same batch without the bad record applies
    delta.apply_many(zip(lives, recs), threads=threads, window=window)
    want = [dtypes.host_bits(n) for n in news]
    assert all(np.array_equal(dtypes.host_bits(lv), w) for lv, w in zip(lives, want))


def test_a_tensor_that_cannot_be_restored_does_not_stop_the_others_and_is_named(monkeypatch):
    """When putting one tensor back fails too, every other tensor is still restored, the original
    error propagates, and a note names the tensor whose bits are now unknown."""
    from ckptdelta.delta import batch

    olds, news, recs = encoded_pairs(31, n=5)
    lives = [o.clone() for o in olds]
    before = [dtypes.host_bits(lv).copy() for lv in lives]
    bad = list(recs)
    bad[3] = _corrupt_payload(recs[3])
    real = batch._Applying.rollback

    def rollback(self):
        if self.name == "layers.1.w":
            raise OSError("device lost")
        real(self)

    monkeypatch.setattr(batch._Applying, "rollback", rollback)
    with pytest.raises(ChecksumError, match=r"layers\.3\.w") as info:
        delta.apply_many(zip(lives, bad), threads=1)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "'layers.1.w'" in notes and "device lost" in notes
    for i in (0, 2, 3, 4):
        assert np.array_equal(dtypes.host_bits(lives[i]), before[i]), f"tensor {i} not restored"


def test_apply_many_reports_the_first_failing_tensor_in_input_order():
    """A big tensor that fails only once written, then one that fails at once: the big one is reported."""
    olds, news, recs = encoded_pairs(40, n=5)
    big = bf16_with_specials((2048, 1024), 41)
    big_new = perturb(big, 0.7, 42)
    olds[1], news[1] = big, big_new
    recs[1] = codec.encode(big, big_new, name="layers.1.w", chunk_elems=1 << 19)
    batch = list(recs)
    batch[1] = _wrong_result_digest(recs[1])        # fails only after it is written
    batch[2] = _corrupt_payload(recs[2])            # fails before anything of it is decoded
    for threads in (1, 2):
        lives = [o.clone() for o in olds]
        with pytest.raises(ChecksumError, match=r"layers\.1\.w"):
            delta.apply_many(zip(lives, batch), threads=threads, window=64)
        assert all(same_bits(lv, o) for lv, o in zip(lives, olds))


@pytest.mark.parametrize("failure", ["wrong parent", "result digest"])
@pytest.mark.parametrize("big_chunk_elems", [1 << 22, 1 << 19])    # the big tensor in one task, or in four
def test_apply_many_restores_tensors_written_ahead_of_the_one_that_fails(failure, big_chunk_elems):
    """One-chunk tensors are written by whichever thread is free, before their turn is judged:
    while a big tensor is checked, the small ones after it get written, and must be restored."""
    olds, news, recs = encoded_pairs(80, n=12, elems=1000, chunk_elems=1 << 22)
    olds[2] = bf16_with_specials((2048, 1024), 81)
    news[2] = perturb(olds[2], 0.5, 82)
    recs[2] = codec.encode(olds[2], news[2], name="layers.2.w", chunk_elems=big_chunk_elems)
    bad = (codec.encode(perturb(olds[2], 0.01, 83), news[2], name="layers.2.w", chunk_elems=big_chunk_elems)
           if failure == "wrong parent" else _wrong_result_digest(recs[2]))
    error = ParentMismatchError if failure == "wrong parent" else ChecksumError
    for _ in range(3):
        lives = [o.clone() for o in olds]
        with pytest.raises(error, match=r"layers\.2\.w"):
            delta.apply_many(zip(lives, [*recs[:2], bad, *recs[3:]]), threads=2, window=64)
        for i, (lv, o) in enumerate(zip(lives, olds)):
            assert same_bits(lv, o), f"tensor {i} changed"


def test_apply_many_rolls_back_when_the_items_themselves_fail():
    olds, news, recs = encoded_pairs(50)
    lives = [o.clone() for o in olds]

    def items():
        yield from zip(lives[:3], recs[:3])
        raise OSError("the store went away")

    with pytest.raises(OSError, match="went away"):
        delta.apply_many(items(), threads=1)
    assert all(same_bits(lv, o) for lv, o in zip(lives, olds))


@pytest.mark.parametrize("threads,window", [(1, None), (2, 2), (2, 4), (2, None)])
def test_a_bad_tensor_read_before_the_items_fail_is_the_error_reported(threads, window):
    """Tensor 1's record does not rebuild its digest; reading the item after it raises. Whatever has
    been judged when the items fail, tensor 1 comes first, so its ChecksumError is what propagates (the
    store's error must not hide a corrupt record read before it), and no tensor is changed."""
    olds, news, recs = encoded_pairs(52, n=3, chunk_elems=1 << 20)             # one chunk a tensor
    h = recs[1].header
    bad = dataclasses.replace(recs[1], header=dataclasses.replace(h, digest=h.digest ^ 1))
    lives = [o.clone() for o in olds]

    def items():
        yield lives[0], recs[0]
        yield lives[1], bad
        raise OSError("the store went away")

    for _ in range(10):       # which tensors are judged when the items fail depends on the threads' timing
        with pytest.raises(ChecksumError, match="layers.1.w"):
            delta.apply_many(items(), threads=threads, window=window)
        assert all(same_bits(lv, o) for lv, o in zip(lives, olds))


# --- nesting -----------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_codec_calls_from_inside_the_codec_pool_cannot_deadlock_it():
    """Every pool worker busy with a call that fans out again: inline there, or all would wait forever."""
    olds, news, recs = encoded_pairs(60, n=3, elems=6000)

    def nested(k: int) -> bool:
        got = codec.encode(olds[0], news[0], name="layers.0.w", chunk_elems=1000)      # _map, 6 chunks
        many = [e.to_bytes() for e in delta.encode_many(zip(["a", "b", "c"], olds, news), threads=2,
                                                          chunk_elems=1000)]
        lives = [o.clone() for o in olds]
        delta.apply_many(zip(lives, recs), threads=2)
        one = olds[1].clone()
        codec.apply_(one, recs[1])
        return (got.to_bytes() == recs[0].to_bytes() and len(many) == 3
                and all(same_bits(lv, n) for lv, n in zip(lives, news)) and same_bits(one, news[1]))

    pool = codec._executor()
    futures = [pool.submit(nested, k) for k in range(2 * (os.cpu_count() or 1))]
    done, not_done = wait(futures, timeout=240)
    assert not not_done, "codec pool deadlocked"
    assert all(f.result() for f in done)
    assert not codec.in_pool_worker()        # the caller's thread is no pool thread


def test_a_pool_that_queues_a_lane_but_cannot_start_its_thread_does_not_hang_close(monkeypatch):
    """ThreadPoolExecutor.submit queues the work before starting a thread; when the start fails it
    raises, the caller runs the lane itself, and the queued copy may still run later."""
    olds, news, recs = encoded_pairs(62, n=12, elems=6000)
    late: list[threading.Thread] = []

    class FlakyPool:
        def submit(self, fn):
            t = threading.Thread(target=fn, daemon=True)
            late.append(t)
            t.start()                       # the queued copy, run later by "the pool"
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(codec, "_executor", lambda: FlakyPool())
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(
        e.to_bytes() for e in delta.encode_many(zip([r.name for r in recs], olds, news), threads=3,
                                                 chunk_elems=1000)), daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "encode_many hung in close()"
    for t in late:
        t.join(30)
    assert out == [r.to_bytes() for r in recs]


def test_a_forked_child_encodes_and_applies_on_threads_of_its_own():
    """The parent's pool threads do not exist in a forked child (fork servers, multiprocessing's
    fork start): the child must start its own pool rather than queue work no thread will run."""
    olds, news, recs = encoded_pairs(61, n=3, elems=6000)
    list(delta.encode_many(zip([r.name for r in recs], olds, news), threads=2, chunk_elems=1000))   # parent pool up
    assert codec._pool is not None
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            got = [e.to_bytes() for e in delta.encode_many(zip([r.name for r in recs], olds, news), threads=2,
                                                            chunk_elems=1000)]
            lives = [o.clone() for o in olds]
            delta.apply_many(zip(lives, recs), threads=2)
            ok = got == [r.to_bytes() for r in recs] and all(same_bits(lv, n) for lv, n in zip(lives, news))
        except BaseException as e:  # noqa: BLE001 - the child reports and exits
            os.write(2, f"child: {e!r}\n".encode())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 240
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's pool")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_records_are_errors_of_the_codec_hierarchy():
    olds, news, recs = encoded_pairs(70, n=2)
    lives = [o.clone() for o in olds]
    with pytest.raises(DeltaError, match="layers.1.w"):
        delta.apply_many(zip(lives, [recs[0], _corrupt_payload(recs[1])]))
    assert all(same_bits(lv, o) for lv, o in zip(lives, olds))


@pytest.mark.parametrize("threads", [1, 2])
def test_an_items_error_comes_after_the_records_before_it(threads):
    """The items themselves failing (a store going away) is an error like a bad item's: the records
    already admitted come out first, whatever the thread count."""
    w = bf16_with_specials((3000,), 15)

    def items():
        for i in range(3):
            yield f"t{i}", w, perturb(w, 0.1, i)
        raise OSError("the store went away")

    out = delta.encode_many(items(), threads=threads, window=16)
    assert [next(out).name for _ in range(3)] == ["t0", "t1", "t2"]
    with pytest.raises(OSError, match="went away"):
        next(out)


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_many_keeps_no_staged_change_once_its_tensor_is_written(monkeypatch, threads):
    """Tensors that are staged, then applied (method="torch", device or strided tensors) keep only
    their undo: the staged new bits (for a dense change, a whole copy of the tensor) must go once
    written, or a batch over a model holds the whole decoded update until it ends."""
    import gc
    import weakref

    refs = []
    real = codec.stage

    def recording(*a, **k):
        st = real(*a, **k)
        refs.append(weakref.ref(st))
        return st

    monkeypatch.setattr(codec, "stage", recording)
    olds, news, recs = encoded_pairs(90, n=6, chunk_elems=1 << 20)
    lives = [o.clone() for o in olds]
    alive = []

    def items():
        for i, (lv, rec) in enumerate(zip(lives, recs)):
            if i >= 2:           # the window is 1 tensor: those before i-1 are written and judged
                gc.collect()
                alive.append(sum(r() is not None for r in refs[:i - 1]))
            yield lv, rec

    delta.apply_many(items(), threads=threads, window=1, method="torch")
    assert all(same_bits(lv, n) for lv, n in zip(lives, news))
    assert alive == [0] * 4


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_apply_many_admits_tensors_by_their_chunks_whatever_the_path(layout):
    """The window counts chunks for staged tensors (device, strided, method="torch") too: each is
    decoded whole on the host, so tensors of three chunks with a window of three come one at a time."""
    olds, news, recs = encoded_pairs(95, n=5, chunk_elems=1000)          # three chunks a tensor
    lives = [o.t().contiguous().t() if layout == "strided" else o.clone() for o in olds]
    applied_before = []

    def items():
        for i, (lv, rec) in enumerate(zip(lives, recs)):
            if i:
                applied_before.append(same_bits(lives[i - 1], news[i - 1]))
            yield lv, rec

    delta.apply_many(items(), threads=2, window=3)
    assert all(same_bits(lv, n) for lv, n in zip(lives, news))
    assert applied_before == [True] * 4


def test_apply_many_reads_the_next_tensor_as_soon_as_one_is_judged(monkeypatch):
    """The window stays full: once tensor i is judged, tensor i + window is read (and its work queued)
    before tensor i + 1 is judged. Judging the whole window before reading more left the other
    thread idle at the end of every window (two threads gained 1.27x, not 1.5x, on a 46 MB step)."""
    from ckptdelta.delta import batch

    events = []
    real = batch._Applying.verdict

    def judged(self, runner):
        real(self, runner)
        events.append(("judged", self.index))

    monkeypatch.setattr(batch._Applying, "verdict", judged)
    olds, news, recs = encoded_pairs(96, n=10, chunk_elems=1 << 20)          # one chunk a tensor
    lives = [o.clone() for o in olds]

    def items():
        for i, (lv, rec) in enumerate(zip(lives, recs)):
            events.append(("read", i))
            yield lv, rec

    delta.apply_many(items(), threads=2, window=3)
    assert all(same_bits(lv, n) for lv, n in zip(lives, news))
    at = {e: k for k, e in enumerate(events)}
    for i in range(10 - 3):
        assert at[("judged", i)] < at[("read", i + 3)] < at[("judged", i + 1)], events


@pytest.mark.parametrize("call", ["apply_", "apply_many"])
def test_a_failure_half_way_through_a_tensors_chunks_leaves_it_unchanged(monkeypatch, call):
    """Writing chunk 2 of 3 fails (out of memory for its undo, say): chunk 1, already written, is put back.
    (A sparse change: a mostly changed tensor is decoded whole into a copy and proven before anything is
    written.)"""
    olds, news, recs = encoded_pairs(97, n=2, chunk_elems=1000)         # three chunks a tensor
    real = codec._write_chunk
    writes = []

    def failing_second(bits, h, i, pos, vals, undo):
        if pos.shape[0]:
            writes.append(i)
            if len(writes) == 2:
                raise MemoryError("no room for the undo")
        return real(bits, h, i, pos, vals, undo)

    monkeypatch.setattr(codec, "_write_chunk", failing_second)
    lives = [o.clone() for o in olds]
    with pytest.raises(MemoryError):
        if call == "apply_":
            codec.apply_(lives[1], recs[1], threads=1)
        else:
            delta.apply_many(zip(lives, recs), threads=1)
    assert writes[:2] == [0, 1]
    assert all(same_bits(lv, o) for lv, o in zip(lives, olds))
