"""The DiT and the VAE as runnable modules: their definitions, the DiT's arithmetic (chosen once per model) and
fused kernels, compilation, CUDA-graph replay and capture, and building them from files."""
