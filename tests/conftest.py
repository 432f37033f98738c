"""Suite-wide settings that must be in place before torch is imported."""

import os

# Tests share two cores with server and worker processes: sleeping OpenMP
# waits keep a descheduled thread from stalling every parallel region.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Property tests draw the same examples on every run in CI, so a red build is reproducible.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass
