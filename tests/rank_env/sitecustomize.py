"""Put first on PYTHONPATH (conftest's `rank_env`), this makes `torch` unimportable in
the process it starts in, as on a Mac that has MLX and no torch: the MLX ranks the distributed
tests launch. transformers (mlx-lm's tokenizer loading) imports torch wherever it is installed,
about 4 s of each rank's start on this 2-core machine, two ranks a test; nothing on the MLX path
needs it, and this shows it does not."""

import sys

sys.modules["torch"] = None   # (`import torch` raises ModuleNotFoundError; find_spec says there is none)
