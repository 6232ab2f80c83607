"""The cfunc torch's OpenMP team runs in the pause: :func:`ckptdelta.delta.commit_ranges.commit_ranges` behind one pointer.

A module of its own so that it is loaded (a cfunc is compiled, or read from
numba's cache, as it is defined) on the first batch a team writes, not on import.
"""

import numpy as np
from numba import carray, cfunc, types

from ckptdelta.delta.commit_ranges import CTL_LEN, commit_ranges


@cfunc(types.void(types.voidptr), cache=True)
def entry(data):
    commit_ranges(carray(data, CTL_LEN, np.int64))
