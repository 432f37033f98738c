"""Suite-wide settings that must be in place before torch is imported."""

import os

# Tests share two cores with server and worker processes: sleeping OpenMP
# waits keep a descheduled thread from stalling every parallel region.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
