"""Publisher(codec="auto"), the default: the context coder or the fast path per delta, from measured encode speed
and upload bandwidth and the decode a replica is predicted to need; every delta published with the predicted
winner, the other codec measured on a sample off the critical path; chains mixing both read, hot-load and
materialize bit-exactly.

The chooser is pure bookkeeping, so most tests feed it timings directly. The publisher tests shape the
timings it measures: a storage wrapper that sleeps in proportion to the bytes uploaded (a slow link), or an
encoder wrapper that spins on its thread's CPU before the context coder's records (a slow context coder beside
a fast disk: a measurement times its encodes by that CPU);
the margins are tens of times any scheduling noise. The measurements on a sample run on a thread of their
own; tests that look at them hold or break the encoder there (a wrapper around the real one, on that thread
only) and wait for that thread. No test asserts how long anything took."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import ckptdelta.publisher.codec_choice as codec_choice
import ckptdelta.publisher.deltas as deltas
import ckptdelta.publisher.explore as explore
from ckptdelta.delta.chunks import DEFAULT_LEVEL
from ckptdelta.delta.codec import EncodedTensor
from ckptdelta.delta.storage import Store
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.codec_choice import CONTEXT, FAST, CodecChooser, Measurement
from tests.publisher_helpers import assert_same, clone, perturb, same_bits

KB, MB, GB = 1e3, 1e6, 1e9

# One delta of each codec as the reference workload measures them (23M bf16 elements, 1% changed, 2 cores).
ELEMENTS, CHANGED = 23_173_632, 234_434
MEASURED = {CONTEXT: (0.088, 212_780), FAST: (0.042, 342_886)}     # encode s, stored bytes


def _feed(ch: CodecChooser, codec: str, bandwidth: float, changed: int = CHANGED, load: float = 1.0) -> None:
    """One delta as MEASURED says, at ``changed`` changed elements, on cores ``load`` times slower."""
    encode_s, stored = MEASURED[codec]
    scale = changed / CHANGED
    ch.observe(codec, elements=ELEMENTS, changed=changed, encode_s=load * encode_s * (0.5 + 0.5 * scale),
               stored_bytes=int(stored * scale), upload_s=stored * scale / bandwidth)


def _pair(ch: CodecChooser, changed: int = CHANGED, load: float = 1.0) -> None:
    """Both codecs measured side by side on a sample of one delta, as MEASURED says (the sample's rates are the
    whole delta's: only rates reach the chooser)."""
    def one(codec: str) -> Measurement:
        encode_s, stored = MEASURED[codec]
        scale = changed / CHANGED
        return Measurement(ELEMENTS, changed, load * encode_s * (0.5 + 0.5 * scale), int(stored * scale))
    ch.observe_pair(one(CONTEXT), one(FAST))


def _measured(ch: CodecChooser, bandwidth: float) -> None:
    """Both codecs published and measured side by side past their first samples (MIN_SAMPLES)."""
    for _ in range(codec_choice.MIN_SAMPLES):
        _feed(ch, CONTEXT, bandwidth)
        _feed(ch, FAST, bandwidth)
        _pair(ch)


def _decode(codec: str) -> float:
    """A replica's decode of one MEASURED delta, as the chooser predicts it (DECODE_WORK)."""
    a, b = codec_choice.DECODE_WORK[codec]
    work = ELEMENTS + codec_choice.WORK_PER_CHANGED[codec] * CHANGED
    return MEASURED[codec][0] / work * (a * ELEMENTS + b * CHANGED)


def _coded(codec: str) -> float:
    return MEASURED[codec][0] + _decode(codec)


def _best(choice) -> str:
    return min(choice.predictions, key=lambda p: p.total_s).codec


# --- the chooser, on injected timings ------------------------------------------------------------------

@pytest.mark.parametrize("bandwidth, winner", [(0.1 * MB, CONTEXT), (2 * MB, CONTEXT), (4 * MB, FAST),
                                               (1 * GB, FAST)])
def test_the_choice_flips_with_the_upload_bandwidth(bandwidth, winner):
    # the fast path saves 46 ms of encoding and 34 ms of a replica's decoding, and moves 130 kB more up to the
    # bucket and down to the replica: it wins above ~3.2 MB/s
    ch = CodecChooser()
    first = ch.choose(ELEMENTS)
    assert first.codec == FAST and first.explore == CONTEXT
    assert first.reason == ("auto: no delta measured yet; the fast path first; measuring context on a sample off "
                            "the critical path (not measured yet)")
    _measured(ch, bandwidth)
    choice = ch.choose(ELEMENTS)
    assert choice.codec == winner and not choice.exploring
    assert choice.reason.startswith(f"auto: predicted {winner} ")
    pred = {p.codec: p for p in choice.predictions}
    assert pred[CONTEXT].stored_bytes == pytest.approx(MEASURED[CONTEXT][1], rel=1e-6)
    assert pred[FAST].stored_bytes == pytest.approx(MEASURED[FAST][1], rel=1e-6)
    assert pred[CONTEXT].encode_s == pytest.approx(MEASURED[CONTEXT][0], rel=1e-6)
    assert pred[FAST].upload_s == pytest.approx(MEASURED[FAST][1] / bandwidth, rel=1e-6)
    assert ch.bandwidth == pytest.approx(bandwidth)


def test_until_a_sample_has_measured_both_codecs_the_fast_path_is_published_even_where_the_priors_favour_context():
    """The priors are full models' sparse steps; on a LoRA run's dense steps the context coder they favour on a slow
    link loses several times over, so no delta is published with it on their word."""
    ch = CodecChooser()
    _feed(ch, FAST, 0.1 * MB)                        # one delta published, nothing measured side by side yet
    choice = ch.choose(ELEMENTS)
    assert not any(p.measured for p in choice.predictions)
    assert min(choice.predictions, key=lambda p: p.total_s).codec == CONTEXT       # what the priors say
    assert choice.codec == FAST and choice.explore == CONTEXT
    assert choice.reason.startswith("auto: the codecs' ratio not measured yet; the fast path until a sample has "
                                    "measured both (from the priors: ")
    _pair(ch)                                         # measured: now the slow link's winner is published
    assert ch.choose(ELEMENTS).codec == CONTEXT


def test_the_break_even_bandwidth_is_where_the_encode_and_decode_saving_pays_for_the_extra_bytes():
    # one part, one fetch batch: each byte is uploaded, then fetched; each delta is encoded, then decoded
    even = 2 * (MEASURED[FAST][1] - MEASURED[CONTEXT][1]) / (_coded(CONTEXT) - _coded(FAST))   # ~3.2 MB/s
    for bw, winner in ((even / 1.2, CONTEXT), (even * 1.2, FAST)):
        ch = CodecChooser()
        _measured(ch, bw)
        assert ch.choose(ELEMENTS).codec == winner, bw


def _codecs_used(bandwidth: float, n: int, explore_every: int, context_s: float | None = None) -> str:
    """Each delta's codec (its initial) and a ``*`` where its choice asked to measure the other codec on a sample,
    that measurement done before the next delta (the context coder's encode ``context_s`` if given)."""
    ch = CodecChooser(explore_every=explore_every)
    used = []
    for _ in range(n):
        c = ch.choose(ELEMENTS)
        assert c.explore in (None, {CONTEXT: FAST, FAST: CONTEXT}[c.codec])
        if c.predictions:
            assert c.codec == _best(c)            # never the codec predicted to lose
        used.append(c.codec[0] + ("*" if c.exploring else ""))
        if context_s is None:
            _feed(ch, c.codec, bandwidth)
        else:
            ch.observe(c.codec, elements=ELEMENTS, changed=CHANGED,
                       encode_s=context_s if c.codec == CONTEXT else 0.05, stored_bytes=200_000, upload_s=0.001)
        if c.exploring:
            if context_s is None:
                _pair(ch)
            else:
                ch.observe_pair(Measurement(ELEMENTS // 16, CHANGED // 16, context_s / 16, 12_500),
                                Measurement(ELEMENTS // 16, CHANGED // 16, 0.05 / 16, 12_500))
    return "".join(used)


def test_the_other_codec_is_measured_every_explore_every_deltas_when_it_loses_little():
    near = 1.2 * 2 * (MEASURED[FAST][1] - MEASURED[CONTEXT][1]) / (_coded(CONTEXT) - _coded(FAST))  # fast wins by 5%
    # every delta is published with the fast path, the predicted winner; the context coder is measured beside
    # the first three (its first 3 samples), then beside one delta in 4
    assert _codecs_used(near, 22, 4) == 3 * "f*" + 4 * (3 * "f" + "f*") + 3 * "f"


def test_the_more_the_other_codec_is_predicted_to_lose_the_less_often_it_is_measured():
    # at 1 GB/s the context coder is predicted 2.2x slower: one delta in round(4 x 2.2) = 9
    assert _codecs_used(1 * GB, 24, 4) == 3 * "f*" + 2 * (8 * "f" + "f*") + 3 * "f"
    # and never less often than one in 4 x explore_every, however much it loses (here 200x)
    assert _codecs_used(0, 40, 4, context_s=10.0) == 3 * "f*" + 2 * (15 * "f" + "f*") + 5 * "f"


def test_on_a_slow_link_every_delta_after_the_first_is_published_with_the_context_coder():
    # at 0.1 MB/s the context coder wins from the second delta on (the priors say so before a pair is
    # measured): the fast path, predicted 1.5x slower, is measured beside one delta in round(4 x 1.5) = 6
    assert _codecs_used(0.1 * MB, 22, 4) == "f*" + 2 * "c*" + 3 * (5 * "c" + "c*") + "c"


def test_an_unmeasured_codec_is_predicted_from_the_other_through_the_priors():
    ch = CodecChooser()
    _feed(ch, FAST, 100 * MB)
    choice = ch.choose(ELEMENTS)
    pred = {p.codec: p for p in choice.predictions}
    assert not pred[CONTEXT].measured and not pred[FAST].measured and ch.ratio() is None
    prior = codec_choice.PRIOR_FAST_VS_CONTEXT
    assert pred[CONTEXT].stored_bytes == pytest.approx(MEASURED[FAST][1] / prior["bytes"], rel=1e-6)
    work = {c: ELEMENTS + codec_choice.WORK_PER_CHANGED[c] * CHANGED for c in (CONTEXT, FAST)}
    assert pred[CONTEXT].encode_s == pytest.approx(
        MEASURED[FAST][0] / work[FAST] / prior["encode"] * work[CONTEXT], rel=1e-6)
    assert "ratio from the priors" in choice.reason and choice.codec == FAST and choice.explore == CONTEXT


def test_a_pair_measured_side_by_side_sets_the_ratio_and_consecutive_deltas_do_not():
    ch = CodecChooser()
    _feed(ch, FAST, 100 * MB)
    _feed(ch, CONTEXT, 100 * MB)                       # the machine may have changed between two deltas
    assert ch.ratio() is None and not any(p.measured for p in ch.choose(ELEMENTS).predictions)
    ctx, fast = Measurement(1_000_000, 10_000, 0.030, 9_000), Measurement(1_000_000, 10_000, 0.010, 12_000)
    ch.observe_pair(ctx, fast)
    wpc = codec_choice.WORK_PER_CHANGED
    rw, rb = ch.ratio()
    assert rw == pytest.approx(0.030 / (1e6 + wpc[CONTEXT] * 1e4) / (0.010 / (1e6 + wpc[FAST] * 1e4)), rel=1e-9)
    assert rb == pytest.approx(9_000 / 12_000, rel=1e-9)
    assert all(p.measured for p in ch.choose(ELEMENTS).predictions)
    # a sample in which nothing changed teaches nothing
    ch.observe_pair(Measurement(1000, 0, 0.001, 0), Measurement(1000, 0, 0.001, 0))
    assert ch.ratio() == (rw, rb)


def test_a_bandwidth_hint_seeds_the_estimate_until_uploads_push_it_out():
    ch = CodecChooser(upload_bandwidth=1 * MB, window=3)
    assert ch.bandwidth == pytest.approx(1 * MB)
    # a delta whose upload took no measurable time: the hint alone says what bytes cost
    ch.observe(CONTEXT, elements=ELEMENTS, changed=CHANGED, encode_s=0.088, stored_bytes=212_780, upload_s=0.0)
    assert ch.bandwidth == pytest.approx(1 * MB) and _best(ch.choose(ELEMENTS)) == CONTEXT
    fast_hint = CodecChooser(upload_bandwidth=1 * GB)
    fast_hint.observe(CONTEXT, elements=ELEMENTS, changed=CHANGED, encode_s=0.088, stored_bytes=212_780,
                      upload_s=0.0)
    assert _best(fast_hint.choose(ELEMENTS)) == FAST
    for _ in range(2):
        _feed(ch, CONTEXT, 100 * MB)
    assert ch.bandwidth == pytest.approx(100 * MB)                     # median of (1, 100, 100) MB/s
    _feed(ch, CONTEXT, 100 * MB)
    assert ch.bandwidth == pytest.approx(100 * MB)                     # the hint has left the window


def test_one_slow_sample_does_not_move_a_median():
    ch = CodecChooser()
    _measured(ch, 100 * MB)
    ch.observe(FAST, elements=ELEMENTS, changed=CHANGED, encode_s=5.0, stored_bytes=342_886, upload_s=0.0034)
    assert ch.choose(ELEMENTS).codec == FAST


def test_a_burst_of_load_moves_both_codecs_together_and_is_forgotten_when_it_ends():
    """On a 2 MB/s link the context coder wins by 30 ms; with every encode 10x slower (other jobs on the
    trainer's cores) the fast path wins by 0.9 s. Samples of one codec from the burst must not make the
    chooser avoid it after the burst, when only the other codec ran meanwhile."""
    ch = CodecChooser()
    _measured(ch, 2 * MB)
    assert ch.choose(ELEMENTS).codec == CONTEXT
    during, after = [], []
    for _ in range(4):
        c = ch.choose(ELEMENTS)
        during.append(c.codec)
        _feed(ch, c.codec, 2 * MB, load=10.0)
        if c.exploring:
            _pair(ch, load=10.0)                        # both codecs slowed alike: the ratio stays
    for _ in range(5):
        c = ch.choose(ELEMENTS)
        after.append(c.codec)
        _feed(ch, c.codec, 2 * MB)
        if c.exploring:
            _pair(ch)
    assert during[-2:] == [FAST, FAST]                  # the level rose: the fast path is cheaper now
    assert after[-3:] == [CONTEXT] * 3                  # and back once the level fell, context samples or not
    wpc = codec_choice.WORK_PER_CHANGED
    assert ch.ratio()[0] == pytest.approx(MEASURED[CONTEXT][0] / MEASURED[FAST][0]
                                          * (ELEMENTS + wpc[FAST] * CHANGED) / (ELEMENTS + wpc[CONTEXT] * CHANGED),
                                          rel=1e-6)


def test_predictions_follow_the_share_of_changed_elements():
    ch = CodecChooser()
    _feed(ch, CONTEXT, 100 * MB)
    _feed(ch, FAST, 100 * MB)
    _pair(ch)
    small = {p.codec: p for p in ch.choose(ELEMENTS).predictions}
    _feed(ch, FAST, 100 * MB, changed=6 * CHANGED)                    # the next one changed 6x as much
    big = {p.codec: p for p in ch.choose(ELEMENTS).predictions}
    assert big[CONTEXT].stored_bytes == pytest.approx(6 * small[CONTEXT].stored_bytes, rel=1e-6)
    assert big[CONTEXT].encode_s > 2 * small[CONTEXT].encode_s


def test_the_prediction_cuts_a_replica_s_fetch_batches_as_the_replica_does():
    """publisher/ may not import loader/: codec_choice keeps its own copy of the reader's batch rule, which must
    stay the reader's (the first batch, the largest, the share of the read the last may hold)."""
    from ckptdelta.loader import reader

    assert (codec_choice.REPLICA_FIRST_BATCH_BYTES, codec_choice.REPLICA_BATCH_BYTES,
            codec_choice.REPLICA_TAIL_SHARE) == (reader.FIRST_BATCH_BYTES, reader.BATCH_BYTES, reader.TAIL_SHARE)


def test_a_delta_of_many_parts_is_predicted_as_a_pipeline(monkeypatch):
    """Parts of 40, 80 and the last ~93 kB (doubling from FIRST_PART_BYTES): on a fast link only the last
    part's upload is left once encoding ends; on a slow one only the first part's encoding precedes the
    uploads. A replica's fetch batches (40, 80, the rest, with no cap of a share of the read) pipeline its
    fetch with its decode the same way."""
    monkeypatch.setattr(deltas, "FIRST_PART_BYTES", 40_000)
    monkeypatch.setattr(codec_choice, "REPLICA_FIRST_BATCH_BYTES", 40_000)
    monkeypatch.setattr(codec_choice, "REPLICA_TAIL_SHARE", 1)
    for bandwidth, upload_bound in ((100 * MB, False), (0.1 * MB, True)):
        ch = CodecChooser(part_bytes=160_000)
        _feed(ch, CONTEXT, bandwidth)
        p = next(p for p in ch.choose(ELEMENTS).predictions if p.codec == CONTEXT)
        assert 200_000 < p.stored_bytes < 240_000
        last = p.stored_bytes - 120_000
        e, u = p.encode_s / p.stored_bytes, p.upload_s / p.stored_bytes   # seconds per byte
        assert (u > e) == upload_bound
        want = 40_000 * e + p.upload_s if upload_bound else p.encode_s + last * u
        assert p.committed_s == pytest.approx(want), bandwidth
        assert max(p.encode_s, p.upload_s) < p.committed_s < p.encode_s + p.upload_s
        assert p.decode_s == pytest.approx(_decode(CONTEXT))
        d = p.decode_s / p.stored_bytes
        assert (u > d) == upload_bound
        fetched = 40_000 * u + p.decode_s if not upload_bound else p.upload_s + last * d
        assert p.total_s == pytest.approx(p.committed_s + fetched), bandwidth


def test_a_replica_s_slower_decode_can_tip_the_choice_to_the_fast_path(monkeypatch):
    """At 2 MB/s the context coder commits sooner (0.19 against 0.21 s); if a replica decoded it 3x slower
    than it encodes, the fast path would swap sooner, and auto takes it."""
    ch = CodecChooser()
    _measured(ch, 2 * MB)
    pred = {p.codec: p for p in ch.choose(ELEMENTS).predictions}
    assert pred[CONTEXT].committed_s < pred[FAST].committed_s and ch.choose(ELEMENTS).codec == CONTEXT
    a, b = codec_choice.DECODE_WORK[CONTEXT]
    monkeypatch.setitem(codec_choice.DECODE_WORK, CONTEXT, (4 * a, 4 * b))
    choice = ch.choose(ELEMENTS)
    pred = {p.codec: p for p in choice.predictions}
    assert pred[CONTEXT].committed_s < pred[FAST].committed_s
    assert pred[FAST].total_s < pred[CONTEXT].total_s
    assert choice.codec == FAST and choice.reason.startswith("auto: predicted fast ")


def test_part_sizes_below_one_byte_are_refused():
    with pytest.raises(ValueError, match="part sizes must be at least 1 byte"):
        deltas.part_sizes(10, part_bytes=0)
    with pytest.raises(ValueError, match="part_bytes must be an int >= 1"):
        CodecChooser(part_bytes=0)


def test_parts_start_small_and_double_up_to_the_part_size():
    MiB = 1 << 20
    assert deltas.part_sizes(35 * MiB) == [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 4 * MiB]
    big = deltas.part_sizes(3000 * MiB)
    assert big[:7] == [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB] and max(big) == 64 * MiB
    assert len(big) == 6 + -(-(3000 - 63) // 64) and sum(big) == 3000 * MiB
    assert deltas.part_sizes(10, part_bytes=1) == [1] * 10 and deltas.part_sizes(0) == []


def test_a_publishers_parts_hold_a_sixteenth_of_the_steps_input_at_most_so_little_is_left_to_upload_after_encoding():
    """A LoRA step of 76 MB of tensors whose delta is 53 MB: doubling alone closes a last part of 22 MB, uploaded
    after the encode; capped at 1/16 of the input, no part passes 4.75 MB. A full model's step keeps 64 MiB parts,
    and a small step's parts are never capped under 1 MiB (nor above the part size asked for)."""
    MiB = 1 << 20
    assert max(deltas.part_sizes(53_000_000)) > 20_000_000
    capped = deltas.part_sizes(53_000_000, deltas.part_bytes_for(76_000_000))
    assert max(capped) == 76_000_000 // 16 and sum(capped) == 53_000_000 and capped[:2] == [1 * MiB, 2 * MiB]
    assert deltas.part_bytes_for(16_000_000_000) == 64 * MiB
    assert deltas.part_bytes_for(1_000_000) == 1 * MiB and deltas.part_bytes_for(1_000_000, 1000) == 1000


def test_nothing_changed_teaches_nothing():
    ch = CodecChooser()
    ch.observe(FAST, elements=ELEMENTS, changed=0, encode_s=0.01, stored_bytes=0, upload_s=0.0)
    assert ch.choose(ELEMENTS).codec == FAST and ch.bandwidth is None and ch.age(CONTEXT) == 0


@pytest.mark.parametrize("kw, match", [
    ({"explore_every": 1}, "explore_every must be an int >= 2"),
    ({"explore_every": 2.5}, "explore_every must be an int >= 2"),
    ({"window": 0}, "window must be an int >= 1"),
    ({"upload_bandwidth": 0}, "upload_bandwidth must be a positive finite number of bytes per second"),
    ({"upload_bandwidth": float("inf")}, "upload_bandwidth must be a positive finite"),
    ({"upload_bandwidth": "1Gbit"}, "upload_bandwidth must be a positive finite"),
])
def test_the_chooser_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        CodecChooser(**kw)


def test_observe_refuses_an_unknown_codec():
    with pytest.raises(ValueError, match="unknown codec 'zstd'"):
        CodecChooser().observe("zstd", elements=1, changed=1, encode_s=1.0, stored_bytes=1, upload_s=1.0)


# --- the sample a measurement encodes -------------------------------------------------------------------

def test_a_sample_is_about_a_sixteenth_picked_by_name_whole_tensors_where_they_fit_and_holds_a_changed_one():
    snap = {f"layers.{i}.w": torch.zeros(explore.SAMPLE_MIN_ELEMENTS // 4) for i in range(256)}
    changed = {"layers.7.w"}
    picked = explore.pick(snap, changed, salt=5)
    assert picked == explore.pick(dict(reversed(snap.items())), changed, salt=5)    # by name, not by order
    assert "layers.7.w" in dict(picked) and len(picked) == 16                      # 1/16 of the elements
    assert all(k == explore.SAMPLE_MIN_ELEMENTS // 4 for _n, k in picked)          # whole tensors
    assert explore.pick(snap, changed, salt=6) != picked                            # another version, another share
    assert explore.pick(snap, set(), salt=5) == []                                  # nothing changed: no sample
    # a large model's tensors are larger than the sample: their leading elements, the cap kept
    cap = explore.SAMPLE_MAX_ELEMENTS
    huge = torch.zeros(1).expand(64 * cap)                  # pick() reads sizes only: no memory behind it
    big = {"mlp": huge, "embed": huge, "norm": torch.zeros(10)}
    picked = explore.pick(big, {"norm", "mlp"}, salt=0)
    assert sum(k for n, k in picked if n != "norm") <= cap and any(n in ("norm", "mlp") for n, _k in picked)
    assert any(n != "norm" and k == cap - (10 if picked[0][0] == "norm" else 0) for n, k in picked)


# --- the publisher's arguments -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"codec": "zstd"}, "codec must be one of 'context', 'fast', 'auto', got 'zstd'"),
    ({"codec": True}, "codec must be one of"),
    ({"codec": "auto", "context_coding": False}, "context_coding=False asks for the fast codec, but codec='auto'"),
    ({"codec": "context", "context_coding": False}, "context_coding=False asks for the fast codec"),
    ({"codec": "fast", "context_coding": True}, "context_coding=True asks for the context codec, but codec='fast'"),
    ({"codec": "auto", "context_coding": True}, "context_coding=True asks for the context codec, but codec='auto'"),
    ({"codec": "context", "upload_bandwidth": 1e6}, "upload_bandwidth only seeds codec='auto'; with codec='context'"),
    ({"codec": "fast", "upload_bandwidth": 1e6}, "upload_bandwidth only seeds codec='auto'"),
    ({"codec": "auto", "upload_bandwidth": -5}, "upload_bandwidth must be a positive finite number"),
    ({"codec": "auto", "upload_bandwidth": True}, "upload_bandwidth must be a positive finite number"),
])
def test_bad_codec_arguments_are_refused_before_anything_is_opened(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        Publisher(str(tmp_path / "run"), progress=False, **kw)
    assert not (tmp_path / "run").exists()


def test_codec_and_its_older_spelling():
    assert Publisher("memory://codec-a", progress=False).codec == "auto"
    assert Publisher("memory://codec-e", progress=False, context_coding=True).codec == CONTEXT
    assert Publisher("memory://codec-b", progress=False, context_coding=False).codec == FAST
    assert Publisher("memory://codec-c", progress=False, codec="fast", context_coding=False).codec == FAST
    assert Publisher("memory://codec-d", progress=False, codec="auto", upload_bandwidth=125e6).codec == "auto"
    assert Publisher("memory://codec-f", progress=False, upload_bandwidth=125e6).codec == "auto"


# --- the publisher, on shaped timings ------------------------------------------------------------------

def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16) for i in range(2)}


def _throttle(pub: Publisher, bytes_per_s: float) -> None:
    """A slow link under the publisher's store: each delta object's upload sleeps for its size / rate."""
    store, put_file = pub.store, pub.store.put_file

    def slow_put_file(key, path):
        put_file(key, path)
        if "/deltas/" in f"/{key}":
            time.sleep(os.path.getsize(path) / bytes_per_s)

    store.put_file = slow_put_file


def _spin(seconds: float) -> None:
    """``seconds`` of this thread's CPU: work, where a sleep is waiting."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _slow_context_coder(monkeypatch, seconds: float) -> None:
    """The context coder ``seconds`` of CPU slower per encode_many call: a published delta's and a measurement's."""
    for module in (deltas, explore):
        real = module.encode_many

        def encode_many(*a, context=True, _real=real, **k):
            if context:
                _spin(seconds)
            return _real(*a, context=context, **k)

        monkeypatch.setattr(module, "encode_many", encode_many)


def _before_measuring(monkeypatch, hook) -> None:
    """``hook()`` runs before each codec's encode of a measurement's sample (on its thread), then the real one."""
    real = explore.encode_many

    def encode_many(*a, **k):
        hook()
        return real(*a, **k)

    monkeypatch.setattr(explore, "encode_many", encode_many)


def _record_encodings(url: str, version: int) -> set[str]:
    r = SnapshotReader(url)
    m = r.manifest(version)
    store = Store.from_url(url)
    out: set[str] = set()
    for e in m.tensors.values():
        if e.object is not None:
            blob = store.get(m.objects[e.object].key, (e.offset, e.offset + e.length))
            out |= set(EncodedTensor.from_bytes(blob).encoding_counts())
    return out


MEASURING = "measuring {} on a sample off the critical path ({})"


def _publish_deltas(pub: Publisher, w: dict[str, torch.Tensor], n: int) -> list:
    """An anchor, then ``n`` deltas, each publish's measurement (if any) finished before the next."""
    pub.publish(w, 0)
    results = []
    for s in range(1, n + 1):
        perturb(w, s)
        results.append(pub.publish(w, s))
        assert pub._explorer.join(30)
    return results


def test_on_a_slow_link_auto_publishes_the_context_coder_from_the_second_delta(tmp_path):
    url = str(tmp_path / "run")
    w = _weights()
    with Publisher(url, progress=False, codec="auto") as pub:
        _throttle(pub, 16 * KB)        # ~4 kB a delta: 0.25 s; the fast path's ~8% more bytes, up and down,
                                       # cost ~30 ms more, over 10x the encode times (and their noise) here
        assert pub.publish(w, 0).codec == ""                         # an anchor has no delta codec
        results = _publish_deltas(pub, w, 4)
    # the fast path first, then the predicted winner; the fast path measured beside the next two (3 pairs)
    assert [r.codec for r in results] == [FAST, CONTEXT, CONTEXT, CONTEXT]
    assert results[0].codec_reason == ("auto: no delta measured yet; the fast path first; "
                                       + MEASURING.format(CONTEXT, "not measured yet"))
    assert results[1].codec_reason.startswith("auto: predicted context ")
    assert results[1].codec_reason.endswith(MEASURING.format(FAST, "1 of its first 3 samples"))
    assert results[2].codec_reason.endswith(MEASURING.format(FAST, "2 of its first 3 samples"))
    assert results[3].codec_reason.startswith("auto: predicted context ") and "measuring" not in results[3].codec_reason
    for r in results:
        assert ("gctx" in _record_encodings(url, r.version)) == (r.codec == CONTEXT), r.version


def test_beside_a_fast_disk_no_delta_is_published_with_the_slower_context_coder(tmp_path, monkeypatch):
    _slow_context_coder(monkeypatch, 0.2)      # the context coder 0.2 s slower; the bytes it saves cost ~0
    url = str(tmp_path / "run")
    w = _weights()
    with Publisher(url, progress=False, codec="auto") as pub:
        pub._explorer.join()
        results = []
        pub.publish(w, 0)
        for s in range(1, 6):
            perturb(w, s)
            results.append(pub.publish(w, s))
            assert pub._explorer.join(30)
        rw, _rb = pub._chooser.ratio()
    # measured beside the first three deltas only, where its sleep costs no publish anything
    assert [r.codec for r in results] == [FAST] * 5
    assert rw > 10                                      # the spin, in the pairs' context encode
    assert [MEASURING.format(CONTEXT, "") [:-3] in r.codec_reason for r in results] == [True] * 3 + [False] * 2
    assert all(r.codec_reason.startswith("auto: predicted fast ") for r in results[1:])
    for r in results:
        assert "gctx" not in _record_encodings(url, r.version), r.version


def test_a_measurement_runs_after_publish_returned_and_one_at_a_time(tmp_path, monkeypatch):
    release, started = threading.Event(), []
    _before_measuring(monkeypatch, lambda: (started.append(threading.current_thread().name), release.wait(30)))
    w = _weights()
    with Publisher(str(tmp_path / "run"), progress=False, codec="auto") as pub:
        pub.publish(w, 0)
        perturb(w, 1)
        first = pub.publish(w, 1)           # returns while its measurement is held before its first encode
        assert first.codec == FAST and first.codec_reason.endswith(MEASURING.format(CONTEXT, "not measured yet"))
        assert pub._explorer.busy and pub._chooser.ratio() is None
        perturb(w, 2)
        second = pub.publish(w, 2)          # no second measurement while one runs
        assert "measuring" not in second.codec_reason
        release.set()
        assert pub._explorer.join(30)
        assert pub._chooser.ratio() is not None      # the pair, measured on a sample of version 1
        perturb(w, 3)
        third = pub.publish(w, 3)
        assert third.codec_reason.endswith(MEASURING.format(_other(third.codec), "1 of its first 3 samples"))
        assert pub._explorer.join(30)
    assert started == ["ckptdelta-explore-v1"] * 2 + ["ckptdelta-explore-v3"] * 2     # both codecs, each time


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="threads have priorities of their own on Linux")
def test_a_measurement_yields_the_cores_to_the_trainer_and_replicas_beside_it(tmp_path, monkeypatch):
    """Its thread runs MEASURE_NICE below the publisher's, which keeps its own priority."""
    seen = []
    _before_measuring(monkeypatch, lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pairs = []
    w = _weights()
    with Publisher(str(tmp_path / "run"), progress=False, codec="auto") as pub:
        real = pub._explorer._on_pair
        pub._explorer._on_pair = lambda c, f: (pairs.append((c, f)), real(c, f))
        _publish_deltas(pub, w, 1)
    assert seen == [min(19, mine + explore.MEASURE_NICE)] * 2        # both codecs' encodes
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine and len(pairs) == 1


def test_a_measurement_is_timed_by_its_thread_s_cpu_not_by_its_wait_for_a_core(monkeypatch):
    """A wait (here: a sleep before each codec's encode) is no encode time: the pair's ratio is the codecs'."""
    w = _weights()
    new = clone(w)
    perturb(new, 1)
    sample = explore.take_sample(w, new, set(new), version=1, explored=CONTEXT)
    _before_measuring(monkeypatch, lambda: time.sleep(0.5))
    context, fast = explore.measure(sample, DEFAULT_LEVEL, threading.Event())
    assert context.changed > 0 and fast.changed > 0
    assert context.encode_s < 0.5 and fast.encode_s < 0.5


def test_a_lora_run_s_first_delta_after_an_anchor_is_not_sampled(tmp_path):
    """It has no grandparent, the next ones do (the context coder's encoding 6): its sample would measure a
    context coder the run's deltas do not get."""
    from ckptdelta.publisher.lora import AdapterSpec, BaseModel

    g = torch.Generator().manual_seed(0)
    names = [f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in range(2) for ab in "AB"]
    w = {n: torch.randn((4, 128) if ".lora_A." in n else (128, 4), generator=g) * 0.02 for n in names}
    spec = AdapterSpec({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
                       BaseModel("base", "0123456789abcdef"))
    with Publisher(str(tmp_path / "run"), progress=False, adapter=spec) as pub:
        results = _publish_deltas(pub, w, 2)
    assert "measuring" not in results[0].codec_reason and results[0].codec == FAST
    assert results[1].codec_reason.endswith(MEASURING.format(_other(results[1].codec), "not measured yet"))


def _other(codec: str) -> str:
    return FAST if codec == CONTEXT else CONTEXT


def test_close_leaves_a_running_measurement_behind_and_learns_nothing_from_it(tmp_path, monkeypatch):
    release, order = threading.Event(), []

    def hold():
        release.wait(30)
        order.append("measuring")

    _before_measuring(monkeypatch, hold)
    w = _weights()
    pub = Publisher(str(tmp_path / "run"), progress=False, codec="auto")
    pub.publish(w, 0)
    perturb(w, 1)
    pub.publish(w, 1)
    assert pub._explorer.busy
    pub.close()
    order.append("closed")
    release.set()
    assert pub._explorer.join(30)
    assert order == ["closed", "measuring"]          # close() did not wait for it
    assert pub._chooser.ratio() is None              # told to stop: no pair reached the chooser


def test_a_measurement_that_fails_is_logged_and_forgotten(tmp_path, monkeypatch, caplog):
    def fail():
        raise RuntimeError("no memory for the sample's encode")

    _before_measuring(monkeypatch, fail)
    url = str(tmp_path / "run")
    w = _weights()
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
        with Publisher(url, progress=False, codec="auto") as pub:
            results = _publish_deltas(pub, w, 3)
            assert pub._chooser.ratio() is None
    assert [r.kind for r in results] == ["delta"] * 3
    # each delta asks again: the failed ones left no pair (which codec wins on a local disk is the timings')
    assert all(r.codec_reason.endswith(MEASURING.format(_other(r.codec), "not measured yet")) for r in results)
    failed = [r.getMessage() for r in caplog.records if "measuring both codecs on a sample" in r.getMessage()]
    assert len(failed) == 3 and "RuntimeError: no memory for the sample's encode" in failed[0]
    assert_same(SnapshotReader(url).read_tensors(3), w)


def test_fixed_codecs_say_so(tmp_path):
    w = _weights()
    for codec in (CONTEXT, FAST):
        with Publisher(str(tmp_path / codec), progress=False, codec=codec) as pub:
            pub.publish(w, 0)
            perturb(w, 1)
            r = pub.publish(w, 1)
        assert (r.codec, r.codec_reason) == (codec, f"fixed: Publisher(codec={codec!r})")


# --- mixed chains ------------------------------------------------------------------------------------

def test_a_chain_mixing_both_codecs_reads_hot_loads_and_materializes_bit_exactly(tmp_path):
    """Each delta from a publisher of its own (a restart: the parent is rebuilt from the mixed chain)."""
    url = str(tmp_path / "run")
    w = _weights()
    w["norm"] = torch.randn(256).to(torch.float32)
    truth = [clone(w)]
    with Publisher(url, progress=False, anchor_every=100) as pub:
        pub.publish(w, 0)
    codecs = [CONTEXT, FAST, FAST, CONTEXT, FAST, CONTEXT]
    for s, codec in enumerate(codecs, start=1):
        perturb(w, s)
        truth.append(clone(w))
        with Publisher(url, progress=False, codec=codec, anchor_every=100, anchor_chain_fraction=100.0) as pub:
            r = pub.publish(w, s)
        assert (r.kind, r.codec) == ("delta", codec)
        assert ("gctx" in _record_encodings(url, r.version)) == (codec == CONTEXT)

    reader = SnapshotReader(url)
    for v, want in enumerate(truth):
        assert_same(reader.read_tensors(v), want)
    rep = reader.verify(len(codecs))                 # raises on any mismatch
    assert rep.chain == list(range(len(truth))) and rep.objects_checked == len(truth)

    out = reader.materialize(len(codecs), str(tmp_path / "ckpt"))
    assert_same(load_file(os.path.join(out, "model.safetensors")), truth[-1])

    live = clone(truth[0])
    sw = HotSwapper(live, SnapshotReader(url), version=0)
    for v in range(1, len(truth)):                 # one delta at a time, each codec in turn
        sw.hotload(v)
        assert all(same_bits(live[k], truth[v][k]) for k in live), v
    sw.hotload(2)                                  # back through the anchor
    assert_same(live, truth[2])
    sw.hotload(len(codecs))                        # several deltas of both codecs in one swap
    assert_same(live, truth[-1])


def test_auto_publishes_a_mixed_chain_a_replica_follows_bit_exactly(tmp_path):
    url = str(tmp_path / "run")
    w = _weights()
    with Publisher(url, progress=False, codec="auto") as pub:
        _throttle(pub, 16 * KB)        # the fast path first, then the context coder (the slow-link test's)
        pub.publish(w, 0)
        live = clone(w)
        sw = HotSwapper(live, SnapshotReader(url), version=0)
        used = []
        for s in range(1, 4):
            perturb(w, s)
            r = pub.publish(w, s)
            used.append(r.codec)
            sw.hotload(r.version)
            assert_same(live, w)
    assert used[0] == FAST and CONTEXT in used
