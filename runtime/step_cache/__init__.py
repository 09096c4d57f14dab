"""Step caching for the DiT: fewer block evaluations per image, behind the sampler's denoiser seam.

core/step_cache_config.py: what is asked (StepCacheConfig, the CLI spec; in core/ because GenerationRequest holds
it); rule.py: which steps are computed; session.py: a run's denoiser and its per-group state; graphs.py: CUDA-graph
replay of block runs; view.py: a pipe that runs with a cache (the node's and the library's with_step_cache);
cli/step_cache_args.py: the command line's flags. docs/step-cache.md says what it does and what it costs.

Only the light names are imported here.
"""
from ..core.step_cache_config import METHODS, OFF, StepCacheConfig, parse_step_cache

__all__ = ["METHODS", "OFF", "StepCacheConfig", "parse_step_cache"]
