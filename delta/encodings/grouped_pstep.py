"""Encoding 9, grouped_pstep: grouped_step (encoding 8) with the step before as context; needs the grandparent.

Payload and fields as encoding 8's (docs/FORMAT.md, "Encodings 8 and 9"); an element's class
also says whether the step before (grandparent to parent) moved it, and its step is coded
negated where that step went down. Adam's steps mostly keep their direction, so the
negated steps are mostly positive: a whole rank-64 bf16 LoRA delta 5-6% smaller than with
encoding 8. The fast path codes a dense chunk of a 16- or 8-bit float with it where its
caller gave the grandparent (a LoRA run's publisher does where the parent is a delta,
and its replicas keep the version before theirs); encoding 8 elsewhere.
"""

from __future__ import annotations

from ckptdelta.delta.encodings.base import register
from ckptdelta.delta.encodings.grouped_step import GroupedStep


class GroupedPrevStep(GroupedStep):
    id = 9
    name = "grouped_pstep"
    needs_grandparent = True
    order = 13
    by_prev = True


ENCODING = register(GroupedPrevStep())
