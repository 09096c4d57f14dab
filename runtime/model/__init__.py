"""The DiT and the VAE as runnable modules: their definitions and kernels, compilation, CUDA-graph replay and
capture, and building them from files."""
