"""Turning noise into latents: the flow-match schedule, the Euler sampler, image inputs, previews."""
