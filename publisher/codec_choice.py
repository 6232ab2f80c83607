"""``Publisher(codec="auto")``, the default: per delta, the context coder or the fast path, whichever
gets the new weights onto the replicas sooner.

The two delta codecs trade CPU for bytes. The context coder (record encoding 5)
writes smaller deltas than the fast path (``codec="fast"``: sparse / XOR planes
with zstd alone), and encodes and decodes more slowly (docs/PERFORMANCE.md).
Which one gets a snapshot swapped in sooner depends on the cores (and how busy
they are) and the link to the bucket, so the publisher measures both and predicts,
before each delta:

    publish() -> swapped(codec) = encode, uploaded part by part   (publish() -> committed)
                                + fetched and decoded on a replica, batch by batch

from what :class:`CodecChooser` learnt from the publisher's own timings
(``write_delta_object``'s ``encode_s`` and ``upload_s``). Each delta gives one sample
of the codec it used: encode seconds per unit of work (a unit is one element of
the snapshot plus ``WORK_PER_CHANGED[codec]`` per changed element: both codecs scan
every element, and pay far more per changed one) and stored bytes per changed
element. Only one codec runs per delta, and the machine's speed drifts (other jobs
on the trainer's cores can make every encode several times slower for a while),
so the two codecs are not compared through samples taken at different times:

- **the ratio** of the context coder's sample to the fast path's, over each pair of
  consecutive deltas that used different codecs (the median of the last
  ``window`` (5) pairs; before the first pair, ``PRIOR_FAST_VS_CONTEXT``);
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

The first delta uses the context coder; from the
second on the smaller prediction wins, except that the other codec is used to
measure it again while it has fewer than ``MIN_SAMPLES`` (3) samples and was not
the previous delta's (in the first half-dozen deltas the two alternate, which
gives the first ratios), and later once it was not used for ``explore_every``
(10) deltas times the ratio of its predicted time to the better one's (at most
4x): one delta in 10 or fewer runs the codec predicted to be slower, the fewer the
more it is predicted to lose, which keeps the ratio current as the share of
changes drifts. Every choice and its reason travel in ``PublishResult.codec`` and
``codec_reason``. Both codecs are lossless and a replica decodes either, record by
record, so a chain mixing them hot-loads and materializes bit-exactly.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from ckptdelta.delta import chunks
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
#: codec predicted to be slower again.
EXPLORE_EVERY = 10
MAX_EXPLORE_STRETCH = 4.0
#: Until a codec has this many samples it is measured again every other delta.
MIN_SAMPLES = 3


def cost_of(codec: str) -> Cost:
    """The cost model of the encoding that stands for ``codec`` (``ckptdelta.delta.chunks.codec_encoding``: the context
    coder's, encoding 5, or the fast path's sparse), where it is declared and its fits are described."""
    return chunks.codec_encoding(codec == CONTEXT).cost


#: Encode work per changed element, in units of one scanned element (``Cost.work_per_changed``): the
#: context coder's fitted ~32, the fast path's ~35.
WORK_PER_CHANGED = {c: cost_of(c).work_per_changed for c in CODECS}
#: The fast path's samples over the context coder's, before a pair of deltas has measured it: seconds per
#: unit of work and bytes per changed element (the encodings' ``Cost.prior_*``: 0.6 and 1.6).
PRIOR_FAST_VS_CONTEXT = {"encode": cost_of(FAST).prior_per_work / cost_of(CONTEXT).prior_per_work,
                         "bytes": cost_of(FAST).prior_bytes_per_changed / cost_of(CONTEXT).prior_bytes_per_changed}
#: A replica's decode (fetched records -> staged changes, digests checked) in units of the same codec's encode
#: work: (per element, per changed element), so decode seconds = the codec's encode seconds per unit of work x
#: (a x elements + b x changed) (``Cost.decode_work``). Fitted to benchmarks/at_scale.py at 1 GB, 2 cores on
#: each side: the decode grows more slowly with the changes than the encode does.
DECODE_WORK = {c: cost_of(c).decode_work for c in CODECS}
#: A replica's fetch batches (loader/reader.py): the first this many bytes, then twice the last, up to
#: REPLICA_BATCH_BYTES.
REPLICA_FIRST_BATCH_BYTES = 4 << 20
REPLICA_BATCH_BYTES = 256 << 20


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
    measured: bool        # False: the codecs' ratio is still the prior (no pair of deltas measured it)

    def describe(self, bandwidth: float) -> str:
        src = "" if self.measured else ", ratio from the priors"
        return (f"{self.codec} {self.total_s:.3f} s (encode {self.encode_s:.3f} s + {_kb(self.stored_bytes)} "
                f"up and down at {bandwidth / 1e6:.3g} MB/s + decode {self.decode_s:.3f} s{src})")


@dataclass(frozen=True)
class Choice:
    """The codec of the next delta, and why."""

    codec: str
    reason: str
    predictions: tuple[Prediction, ...] = ()
    exploring: bool = False

    @property
    def context(self) -> bool:
        return self.codec == CONTEXT


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
    elements about to be encoded, then :meth:`observe` with what writing it took.
    Pure bookkeeping: no clock, no I/O, so tests feed it timings directly.
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
        self._recent: deque[_Sample] = deque(maxlen=LEVEL_SAMPLES)     # newest samples, either codec
        self._pairs: deque[tuple[float, float]] = deque(maxlen=window)  # context / fast: (per work, per changed)
        self._bandwidth: deque[float] = deque(maxlen=window)             # bytes/s
        hint = check_bandwidth(upload_bandwidth)
        if hint is not None:
            self._bandwidth.append(hint)
        self._deltas = 0                                                 # deltas observed
        self._seen = {c: 0 for c in CODECS}                              # _deltas at each codec's newest sample
        self._count = {c: 0 for c in CODECS}                             # samples of each codec
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
        from pairs of consecutive deltas; None before the first pair."""
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
        swapped = committed + _pipeline(deltas.part_sizes(nbytes, REPLICA_BATCH_BYTES, REPLICA_FIRST_BATCH_BYTES),
                                        upload_s, decode_s)    # fetched at the link's rate, as uploaded
        return Prediction(codec, encode_s, stored, upload_s, committed, decode_s, swapped, measured)

    def choose(self, elements: int) -> Choice:
        """The codec for the next delta of ``elements`` elements (this rank's)."""
        preds = [self.predict(c, elements) for c in CODECS]
        if any(p is None for p in preds):
            why = "no delta measured yet" if self._share is None else "no upload measured yet"
            return Choice(CONTEXT, f"auto: {why}; the context coder first")
        best, other = sorted(preds, key=lambda p: p.total_s)
        bw = self.bandwidth
        age, n = self.age(other.codec), self._count[other.codec]
        stretch = min(MAX_EXPLORE_STRETCH, other.total_s / max(best.total_s, 1e-12))
        if age >= (1 if n < MIN_SAMPLES else round(self.explore_every * stretch) - 1):
            when = (f"last measured {age} deltas ago" if n >= MIN_SAMPLES else
                    f"{n} of its first {MIN_SAMPLES} samples" if n else "not measured yet")
            return Choice(other.codec, f"auto: exploring {other.codec} ({when}); predicted {other.describe(bw)} "
                          f"vs {best.describe(bw)}", tuple(preds), exploring=True)
        return Choice(best.codec, f"auto: predicted {best.describe(bw)} < {other.describe(bw)}", tuple(preds))

    def observe(self, codec: str, *, elements: int, changed: int, encode_s: float, stored_bytes: int,
                upload_s: float) -> None:
        """What one delta took: its codec, elements scanned and changed, encode and upload seconds, bytes."""
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; known: {CODECS}")
        if changed <= 0 or elements <= 0 or stored_bytes <= 0:
            return      # nothing changed, nothing written: nothing learnt about either codec or the link
        work = elements + WORK_PER_CHANGED[codec] * changed
        sample = _Sample(codec, max(encode_s, 1e-9) / work, stored_bytes / changed)
        prev = self._recent[-1] if self._recent else None
        if prev is not None and prev.codec != codec:
            ctx, fast = (sample, prev) if codec == CONTEXT else (prev, sample)
            self._pairs.append((ctx.per_work / fast.per_work, ctx.per_changed / fast.per_changed))
        self._recent.append(sample)
        self._deltas += 1
        self._seen[codec] = self._deltas
        self._count[codec] += 1
        self._share = changed / elements
        if upload_s > 0:
            self._bandwidth.append(stored_bytes / upload_s)


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
