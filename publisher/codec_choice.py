"""``Publisher(codec="auto")``, the default: per delta, the context coder or the fast path, whichever
gets the new weights onto the replicas sooner.

The two delta codecs trade CPU for bytes. The context coder (record encoding 5)
writes smaller deltas than the fast path (``codec="fast"``: sparse / dense steps / XOR planes
with zstd alone), and encodes and decodes more slowly (docs/PERFORMANCE.md).
Which one gets a snapshot swapped in sooner depends on the cores (and how busy
they are) and the link to the bucket, so the publisher measures both and predicts,
before each delta:

    publish() -> swapped(codec) = encode, uploaded part by part   (publish() -> committed)
                                + fetched and decoded on a replica, batch by batch

from what :class:`CodecChooser` learnt from the publisher's own timings. Each published
delta gives one sample of its codec (``write_delta_object``'s ``encode_s`` and
``upload_s``): encode seconds per unit of work (a unit is one element of the snapshot
plus ``WORK_PER_CHANGED[codec]`` per changed element: both codecs scan every element,
and pay far more per changed one) and stored bytes per changed element. The machine's
speed drifts (other jobs on the trainer's cores can make every encode several times
slower for a while), so the two codecs are compared only where they ran side by side:

- **the ratio** of the context coder's sample to the fast path's, each pair measured
  on one sample of one delta's tensors, one codec right after the other
  (:meth:`CodecChooser.observe_pair`; the median of the last ``window`` (5) pairs;
  before the first pair, ``PRIOR_FAST_VS_CONTEXT``);
- **the level**: the median of the last ``LEVEL_SAMPLES`` (3) samples of either codec,
  each brought to the context coder's scale through the ratio. So a burst of load
  moves both predictions together and is forgotten three deltas after it ends;
- **the upload throughput**: the median of the last ``window`` values of ``stored
  bytes / upload_s`` (either codec: it is the link's). It includes each request's
  latency, so with small objects it understates the link, which only ever
  favours the smaller output; ``upload_bandwidth`` (bytes/s) seeds it as the
  oldest sample.

The next delta's changed elements are predicted from the last one's share.
A delta's parts upload while later parts encode (``deltas.part_sizes``: 4 MiB,
then twice the last, up to 64 MiB), so the prediction runs that two-stage
pipeline over the parts rather than adding the stages. A replica fetches the
committed delta in batches (4 MiB, then twice the last, up to 256 MiB) and
decodes each while it fetches the next: the same pipeline, over its link (taken
to be as fast as the trainer's: both reach one bucket) and its decode, which the
publisher cannot time, so it is predicted from the encode's level: ``DECODE_WORK``
units of the codec's encode work per element and per changed element, as measured
with equal cores on both sides. A replica host with many more cores than the
trainer's decodes faster than that predicts, and one whose trainer is loaded by
other jobs is predicted slower; either overstates or understates the context
coder's cost only where the two codecs are close.

Every delta is published with the codec predicted to win. Before anything is measured
that is the fast path, the one whose worst case is bounded: it spends a fraction of the
context coder's CPU per changed element at both ends, and what the context coder would
save is a share of the bytes, which the link moves at its rate. So the wrong first guess
costs those bytes' transfer on one delta, where the other wrong guess would cost a
several-times-slower encode and decode. That first delta gives the level and the link's
rate that every later prediction starts from. The same holds until a sample has measured
both codecs side by side: the priors are fitted to full models' sparse steps, and on a LoRA
run's dense steps the context coder they favour on a slow link loses several times over,
so until then the fast path is published whatever they predict.

The codec predicted to lose is still measured, but never by publishing a delta with it:
a :class:`Choice` names it in ``explore``, and the publisher then encodes a sample of
that delta's tensors (about 1/16 of its elements) with both codecs, into
memory, on a thread of its own after publish() has returned (publisher/explore.py), and
feeds the pair to :meth:`CodecChooser.observe_pair`. It asks so while the codecs have
fewer than ``MIN_SAMPLES`` (3) pairs (in the first deltas: every delta whose publish
finds no measurement still running), and later once the codec predicted to lose was not
measured for ``explore_every`` (10) deltas times the ratio of its predicted time to the
better one's (at most 4x): the more it is predicted to lose, the less often, which keeps
the ratio current as the share of changes drifts. Every choice and its reason travel in
``PublishResult.codec`` and ``codec_reason``. Both codecs are lossless and a replica
decodes either, record by record, so a chain mixing them hot-loads and materializes
bit-exactly.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from ckptdelta.delta import chunks, doubling
from ckptdelta.delta.encodings import Cost

from ckptdelta.publisher import deltas

log = logging.getLogger("ckptdelta.publisher")

CONTEXT, FAST = "context", "fast"
CODECS = (CONTEXT, FAST)

#: Pairs the ratio is the median of, and upload samples the bandwidth is the median of.
WINDOW = 5
#: Newest samples (either codec) the level is the median of.
LEVEL_SAMPLES = 3
#: One delta in this many, times the predicted loss (other / best, 1 to MAX_EXPLORE_STRETCH), measures the
#: codec predicted to be slower again (on a sample, off the critical path).
EXPLORE_EVERY = 10
MAX_EXPLORE_STRETCH = 4.0
#: Until a codec has this many samples measured side by side with the other (pairs), it is measured with every
#: delta that finds no measurement running (a published delta is no such sample: nothing ran beside it).
MIN_SAMPLES = 3


def cost_of(codec: str) -> Cost:
    """The cost model of the encoding that stands for ``codec`` (``ckptdelta.delta.chunks.codec_encoding``: the context
    coder's, encoding 5, or the fast path's sparse), where it is declared and its fits are described."""
    return chunks.codec_encoding(codec == CONTEXT).cost


#: Encode work per changed element, in units of one scanned element (``Cost.work_per_changed``): the
#: context coder's fitted ~32, the fast path's ~35.
WORK_PER_CHANGED = {c: cost_of(c).work_per_changed for c in CODECS}
#: The fast path's samples over the context coder's, before a pair has measured it: seconds per
#: unit of work and bytes per changed element (the encodings' ``Cost.prior_*``: 0.6 and 1.6).
PRIOR_FAST_VS_CONTEXT = {"encode": cost_of(FAST).prior_per_work / cost_of(CONTEXT).prior_per_work,
                         "bytes": cost_of(FAST).prior_bytes_per_changed / cost_of(CONTEXT).prior_bytes_per_changed}
#: A replica's decode (fetched records -> staged changes, digests checked) in units of the same codec's encode
#: work: (per element, per changed element), so decode seconds = the codec's encode seconds per unit of work x
#: (a x elements + b x changed) (``Cost.decode_work``). Fitted to benchmarks/at_scale.py at 1 GB, 2 cores on
#: each side: the decode grows more slowly with the changes than the encode does.
DECODE_WORK = {c: cost_of(c).decode_work for c in CODECS}
#: A replica's fetch batches (loader/reader.py): the first this many bytes, then twice the last, up to
#: REPLICA_BATCH_BYTES or 1/REPLICA_TAIL_SHARE of the read, whichever is smaller (a batch that finishes one of the
#: delta's parts may take up to twice its limit: fetch_batches; the prediction leaves that out).
REPLICA_FIRST_BATCH_BYTES = 1 << 20
REPLICA_BATCH_BYTES = 256 << 20
REPLICA_TAIL_SHARE = 8


@dataclass(frozen=True)
class Prediction:
    """One codec's predicted publish of the next delta."""

    codec: str
    encode_s: float
    stored_bytes: float
    upload_s: float
    committed_s: float    # publish() -> committed: encode and upload, pipelined over the parts
    decode_s: float       # a replica's decode (predicted from the encode's level: DECODE_WORK)
    total_s: float        # publish() -> swapped: committed_s, then the replica's fetch and decode, pipelined
    measured: bool        # False: the codecs' ratio is still the prior (no pair measured it)

    def describe(self, bandwidth: float) -> str:
        src = "" if self.measured else ", ratio from the priors"
        return (f"{self.codec} {self.total_s:.3f} s (encode {self.encode_s:.3f} s + {_kb(self.stored_bytes)} "
                f"up and down at {bandwidth / 1e6:.3g} MB/s + decode {self.decode_s:.3f} s{src})")


@dataclass(frozen=True)
class Choice:
    """The codec the next delta is published with (always the one predicted to win), why, and the codec to
    measure beside it on a sample of that delta, off the publish's critical path (None: none now)."""

    codec: str
    reason: str
    predictions: tuple[Prediction, ...] = ()
    explore: str | None = None

    @property
    def context(self) -> bool:
        return self.codec == CONTEXT

    @property
    def exploring(self) -> bool:
        """Whether this delta's tensors are to be sampled to measure ``explore`` (the delta itself is not)."""
        return self.explore is not None


@dataclass(frozen=True)
class Measurement:
    """One codec's encode of a sample: elements scanned and changed, seconds, bytes out."""

    elements: int
    changed: int
    encode_s: float
    stored_bytes: int


@dataclass(frozen=True)
class _Sample:
    codec: str
    per_work: float       # encode seconds per unit of work
    per_changed: float    # stored bytes per changed element


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def _pipeline(sizes: list[int], first_s: float, second_s: float) -> float:
    """Seconds until the last of ``sizes`` has passed two stages in turn (``first_s`` and ``second_s`` for
    all of them, shared in proportion to size), each part entering the second stage once it has left the
    first and the part before it has left the second."""
    whole = sum(sizes)
    first = second = 0.0
    for size in sizes:
        share = size / whole
        first += first_s * share
        second = max(first, second) + second_s * share
    return second


def _median(xs) -> float:
    """The median in log space (a geometric middle for an even count): every estimate here is a rate."""
    return math.exp(statistics.median(math.log(x) for x in xs))


def check_bandwidth(value: object) -> float | None:
    """``upload_bandwidth`` as a float, or None; a clear ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"upload_bandwidth must be a positive finite number of bytes per second "
                         f"(e.g. 125e6 for 1 Gbit/s), got {value!r}")
    return float(value)


class CodecChooser:
    """What both codecs cost on this trainer and link, learnt delta by delta.

    Per delta (one rank's share of it), in order: :meth:`choose` with the number of
    elements about to be encoded, then :meth:`observe` with what writing it took; and
    whenever a choice asked for a measurement, :meth:`observe_pair` with it once it is
    done (later: other deltas may be chosen and observed meanwhile). Pure bookkeeping:
    no clock, no I/O, no lock (the caller serializes the calls), so tests feed it
    timings directly.
    """

    def __init__(self, upload_bandwidth: float | None = None, *, explore_every: int | None = None,
                 window: int = WINDOW, part_bytes: int | None = None):
        explore_every = EXPLORE_EVERY if explore_every is None else explore_every
        if isinstance(explore_every, bool) or not (isinstance(explore_every, int) and explore_every >= 2):
            raise ValueError(f"explore_every must be an int >= 2, got {explore_every!r}")
        if isinstance(window, bool) or not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if part_bytes is None:
            part_bytes = deltas.DEFAULT_PART_BYTES
        if isinstance(part_bytes, bool) or not (isinstance(part_bytes, int) and part_bytes >= 1):
            raise ValueError(f"part_bytes must be an int >= 1, got {part_bytes!r}")
        self.explore_every, self.part_bytes = explore_every, part_bytes
        self._recent: deque[_Sample] = deque(maxlen=LEVEL_SAMPLES)     # newest published deltas, either codec
        self._pairs: deque[tuple[float, float]] = deque(maxlen=window)  # context / fast: (per work, per changed)
        self._bandwidth: deque[float] = deque(maxlen=window)             # bytes/s
        hint = check_bandwidth(upload_bandwidth)
        if hint is not None:
            self._bandwidth.append(hint)
        self._deltas = 0                                                 # deltas observed
        self._seen = {c: 0 for c in CODECS}                              # _deltas at each codec's newest sample
        self._count = {c: 0 for c in CODECS}           # samples of each codec measured side by side (pairs)
        self._share: float | None = None                                 # changed / elements of the newest delta

    @property
    def bandwidth(self) -> float | None:
        """The upload bandwidth estimate, bytes/s (None before any upload or hint)."""
        return _median(self._bandwidth) if self._bandwidth else None

    def age(self, codec: str) -> int:
        """Deltas observed since ``codec``'s newest sample (since the start if it has none)."""
        return self._deltas - self._seen[codec]

    def ratio(self) -> tuple[float, float] | None:
        """The context coder's (encode seconds per unit of work, bytes per changed element) over the fast path's,
        from the pairs measured side by side; None before the first pair."""
        if not self._pairs:
            return None
        return _median(p[0] for p in self._pairs), _median(p[1] for p in self._pairs)

    def _ratio_or_prior(self) -> tuple[float, float, bool]:
        r = self.ratio()
        if r is None:
            return 1 / PRIOR_FAST_VS_CONTEXT["encode"], 1 / PRIOR_FAST_VS_CONTEXT["bytes"], False
        return r[0], r[1], True

    def predict(self, codec: str, elements: int) -> Prediction | None:
        """``codec``'s publish of ``elements`` elements at the newest delta's share of changes."""
        bw = self.bandwidth
        if self._share is None or bw is None or not self._recent:
            return None
        rw, rb, measured = self._ratio_or_prior()
        # the level, on the context coder's scale
        work = _median(s.per_work * (1 if s.codec == CONTEXT else rw) for s in self._recent)
        per_changed = _median(s.per_changed * (1 if s.codec == CONTEXT else rb) for s in self._recent)
        if codec == FAST:
            work, per_changed = work / rw, per_changed / rb
        changed = self._share * elements
        encode_s = work * (elements + WORK_PER_CHANGED[codec] * changed)
        stored = per_changed * changed
        upload_s = stored / bw
        a, b = DECODE_WORK[codec]
        decode_s = work * (a * elements + b * changed)
        nbytes = max(1, math.ceil(stored))
        committed = _pipeline(deltas.part_sizes(nbytes, self.part_bytes, deltas.FIRST_PART_BYTES), encode_s,
                              upload_s)
        batch = doubling.capped(nbytes, REPLICA_BATCH_BYTES, REPLICA_FIRST_BATCH_BYTES, REPLICA_TAIL_SHARE)
        swapped = committed + _pipeline(deltas.part_sizes(nbytes, batch, REPLICA_FIRST_BATCH_BYTES),
                                        upload_s, decode_s)    # fetched at the link's rate, as uploaded
        return Prediction(codec, encode_s, stored, upload_s, committed, decode_s, swapped, measured)

    def choose(self, elements: int, *, may_explore: bool = True) -> Choice:
        """The codec for the next delta of ``elements`` elements (this rank's), and whether to measure the other
        one on a sample of it; ``may_explore=False`` (a measurement is still running) never asks for one."""
        preds = [self.predict(c, elements) for c in CODECS]
        if any(p is None for p in preds):
            why = "no delta measured yet" if self._share is None else "no upload measured yet"
            best, other, base = FAST, CONTEXT, f"auto: {why}; the fast path first"
            stretch = MAX_EXPLORE_STRETCH
            preds = []
        elif not preds[0].measured:
            # the ratio is still the priors' (fitted to full models' sparse steps): they may favour the context
            # coder where it loses several times over (a LoRA run's dense steps), so, as for the first delta,
            # the fast path until a sample has measured both
            bw = self.bandwidth
            best, other = FAST, CONTEXT
            base = (f"auto: the codecs' ratio not measured yet; the fast path until a sample has measured both "
                    f"(from the priors: {' vs '.join(p.describe(bw) for p in preds)})")
            stretch = MAX_EXPLORE_STRETCH
        else:
            best_p, other_p = sorted(preds, key=lambda p: p.total_s)
            bw = self.bandwidth
            best, other = best_p.codec, other_p.codec
            base = f"auto: predicted {best_p.describe(bw)} < {other_p.describe(bw)}"
            stretch = min(MAX_EXPLORE_STRETCH, other_p.total_s / max(best_p.total_s, 1e-12))
        age, n = self.age(other), self._count[other]
        if may_explore and (n < MIN_SAMPLES or age >= round(self.explore_every * stretch) - 1):
            when = (f"last measured {age} deltas ago" if n >= MIN_SAMPLES else
                    f"{n} of its first {MIN_SAMPLES} samples" if n else "not measured yet")
            return Choice(best, f"{base}; measuring {other} on a sample off the critical path ({when})",
                          tuple(preds), explore=other)
        return Choice(best, base, tuple(preds))

    def observe(self, codec: str, *, elements: int, changed: int, encode_s: float, stored_bytes: int,
                upload_s: float) -> None:
        """What one published delta took: its codec, elements scanned and changed, encode and upload seconds,
        bytes."""
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; known: {CODECS}")
        if changed <= 0 or elements <= 0 or stored_bytes <= 0:
            return      # nothing changed, nothing written: nothing learnt about either codec or the link
        self._recent.append(_sample(codec, elements, changed, encode_s, stored_bytes))
        self._deltas += 1
        self._seen[codec] = self._deltas
        self._share = changed / elements
        if upload_s > 0:
            self._bandwidth.append(stored_bytes / upload_s)

    def observe_pair(self, context: Measurement, fast: Measurement) -> None:
        """Both codecs' encodes of one sample, one right after the other: a pair for the ratio, and a sample
        of each codec for the rules of when to measure again (its age counted from the newest published delta)."""
        if min(context.changed, fast.changed, context.stored_bytes, fast.stored_bytes, context.elements,
               fast.elements) <= 0:
            return      # nothing changed in the sample: nothing learnt
        ctx = _sample(CONTEXT, context.elements, context.changed, context.encode_s, context.stored_bytes)
        fst = _sample(FAST, fast.elements, fast.changed, fast.encode_s, fast.stored_bytes)
        self._pairs.append((ctx.per_work / fst.per_work, ctx.per_changed / fst.per_changed))
        for c in CODECS:
            self._seen[c] = self._deltas
            self._count[c] += 1


def _sample(codec: str, elements: int, changed: int, encode_s: float, stored_bytes: int) -> _Sample:
    work = elements + WORK_PER_CHANGED[codec] * changed
    return _Sample(codec, max(encode_s, 1e-9) / work, stored_bytes / changed)


def warm_up(dtypes: "set[torch.dtype] | None" = None) -> None:
    """Load both codecs' kernels for ``dtypes`` (default: every float dtype the codec specialises) from numba's
    on-disk cache and start the codec pool, so no delta's ``encode_s`` includes that once-per-process cost
    (most of it at the context coder's first tensor, less for each further dtype and codec). ``Publisher(codec=
    "auto")`` runs it before its first delta of each dtype, outside the delta's timing (a run of anchors only,
    or a fixed codec, never pays for it)."""
    from ckptdelta.delta.batch import encode_many
    from ckptdelta.delta.warmup import DTYPES

    try:
        g = torch.Generator().manual_seed(0)
        for dtype in DTYPES:
            if dtypes is not None and dtype not in dtypes:
                continue
            old = (torch.randn(1 << 12, generator=g) * 0.05).to(dtype)
            moved = (old.float() * (1 + 0.01 * torch.randn(old.shape, generator=g))).to(dtype)
            new = torch.where(torch.rand(old.shape, generator=g) < 0.05, moved, old)
            for context in (True, False):
                for _ in encode_many([("warm-up", old, new)], context=context):
                    pass
    except Exception as e:  # noqa: BLE001 - only the first delta's timing is at stake
        log.debug("codec warm-up failed: %s", e)
