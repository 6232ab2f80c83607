"""The suite, laid out as the packages it tests (tests/delta/, tests/publisher/, tests/loader/, ...); the helpers
every part shares (replica harnesses, servers, tiny models) stay here, importable as ``tests.<name>``."""

import os

#: the repository's root and this folder, for tests that open docs/, benchmarks/ or tests/' own data by path
#: wherever in the tree they sit
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
