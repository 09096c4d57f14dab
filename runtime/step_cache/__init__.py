"""Step caching for the DiT: fewer block evaluations per image, behind the sampler's denoiser seam.

config.py: what is asked (StepCacheConfig, the CLI spec); rule.py: which steps are computed; session.py: a run's
denoiser and its per-group state; graphs.py: CUDA-graph replay of block runs; view.py: a pipe that runs with a cache
(the node's and the library's with_step_cache). docs/step-cache.md says what it does and what it costs.

Only the light names are imported here (request.py imports this package's config).
"""
from .config import METHODS, OFF, StepCacheConfig, parse_step_cache

__all__ = ["METHODS", "OFF", "StepCacheConfig", "parse_step_cache"]
