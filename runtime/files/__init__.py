"""The user's files: images and masks read, PNGs and other outputs written whole (never half on a Ctrl-C or a full
disk), inputs never overwritten."""
