"""What every part shares: errors, the host interface, the request and its result, the pipe protocol, and the
model variant (Base or Turbo)."""
