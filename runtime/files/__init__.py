"""The user's files: image and mask files read, PNGs and other outputs written whole, inputs never overwritten."""
